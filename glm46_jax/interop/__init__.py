"""Other formats: Hugging Face safetensors directories (both ways), checkpoint conversion, PEFT adapter directories."""
