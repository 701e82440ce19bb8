#!/usr/bin/env bash
# Print the path of a Python interpreter whose version lies in [MIN, MAX] (default: 3.12 or newer).
#
#   .ci/find_python.sh            # any Python >= 3.12 (what the main .venv needs: jax >= 0.11.2 requires it)
#   .ci/find_python.sh 3.11 3.11 PYTHON_HF  # exactly 3.11 (the optional .venv-hf that regenerates HF fixtures)
# The optional third argument names the make variable that overrides the search (used in the error message).
#
# Search order, first match wins. Python MIN itself (3.12 by default, the version the stack was verified on) is
# preferred over newer ones:
#   1. pythonMIN, then python3.13, python3.12, python3.11, python3 on PATH. Each candidate is *run*; one that fails
#      (for example a pyenv shim for a version that is installed but not selected) is skipped.
#   2. pyenv installs: $(pyenv root)/versions/3.*/bin/python, or $HOME/.pyenv/versions/... when pyenv is not on
#      PATH (PYENV_ROOT is honoured); MIN.* first, then the rest newest first.
# Prints the real interpreter path (sys.executable, so pyenv shims are resolved) and exits 0, or explains on
# stderr what to install and exits 1.
set -u

min="${1:-3.12}"
max="${2:-}"
var="${3:-PYTHON}"
min_t="(${min%%.*}, ${min#*.})"
if [ -n "$max" ]; then max_t="(${max%%.*}, ${max#*.})"; else max_t="(99, 99)"; fi
# Exits 1 when out of range, else prints the real interpreter path.
probe="import sys; v = sys.version_info[:2]; ok = $min_t <= v <= $max_t; print(sys.executable) if ok else sys.exit(1)"

try() {  # try PYTHON: on success print its sys.executable and exit the script
  local exe
  exe="$("$1" -c "$probe" 2>/dev/null)" || return 0
  [ -n "$exe" ] || return 0
  printf '%s\n' "$exe"
  exit 0
}

names=("python$min")
for n in python3.13 python3.12 python3.11 python3; do [ "$n" = "python$min" ] || names+=("$n"); done
for name in "${names[@]}"; do
  if command -v "$name" >/dev/null 2>&1; then try "$name"; fi
done

roots=()
if command -v pyenv >/dev/null 2>&1; then
  r="$(pyenv root 2>/dev/null)" && [ -n "$r" ] && roots+=("$r")
fi
roots+=("${PYENV_ROOT:-$HOME/.pyenv}")
for root in "${roots[@]}"; do
  [ -d "$root/versions" ] || continue
  # Only plain CPython versions (3.X or 3.X.Y): MIN.* first, then newest first.
  all="$(ls -1 "$root/versions" 2>/dev/null | grep -E '^3\.[0-9]+(\.[0-9]+)?$' | sort -t. -k1,1nr -k2,2nr -k3,3nr)"
  for v in $(grep -E "^${min//./\\.}(\.|$)" <<<"$all"; grep -vE "^${min//./\\.}(\.|$)" <<<"$all"); do
    [ -x "$root/versions/$v/bin/python" ] && try "$root/versions/$v/bin/python"
  done
done

want="Python >= $min"
[ -n "$max" ] && { [ "$max" = "$min" ] && want="Python $min" || want="Python $min..$max"; }
{
  echo "error: no $want interpreter found."
  echo "  Looked for $(IFS=/; echo "${names[*]}") on PATH (each one run; failing pyenv"
  echo "  shims are skipped) and in pyenv's versions directory (${PYENV_ROOT:-$HOME/.pyenv}/versions)."
  if [ "$min" = "3.12" ] && [ -z "$max" ]; then
    echo "  glm46_jax needs Python >= 3.12: jax/jaxlib >= 0.11.2 and flax >= 0.12.10 require it (on 3.11 pip would"
    echo "  silently install jax 0.10, whose APIs differ)."
  fi
  echo "  Install $want, for example one of:"
  echo "    pyenv install ${min}         # then re-run make; pyenv versions are found without 'pyenv shell'"
  echo "    uv python install ${min}"
  echo "    apt-get install python${min} python${min}-venv   # Debian/Ubuntu (deadsnakes PPA on older releases)"
  echo "    or an installer from https://www.python.org/downloads/"
  echo "  Or point make at one explicitly:  make $var=/path/to/python${min} ..."
} >&2
exit 1
