"""Other formats, both ways:

    hf         Hugging Face GLM-4.5/4.6 safetensors directories <-> our parameter pytrees
    convert    training checkpoints <-> HF directories (`python -m glm46_jax.convert`)
    peft       PEFT adapter directories <-> our LoRA adapters
    quantize   an HF export rewritten in the compressed-tensors format vLLM and SGLang load
    reward     a reward model (or critic) on disk: the causal-LM export plus the score head
    chat       GLM-4.5/4.6's chat format: messages -> text -> token ids, with the assistant's loss mask
"""
