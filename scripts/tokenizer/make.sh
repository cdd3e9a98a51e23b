#!/usr/bin/env bash
# Remakes the tiny model's tokenizer (router/tests/data/tokenize/tiny) and the router's
# tokenization fixtures (router/tests/data/tokenize/expected.json) with Hugging Face's Python
# tokenizers and Jinja2, in a virtual environment of its own (target/tokenizer-venv; the two
# packages from the Python registry). The repository holds what it makes; run it after changing
# the cases, the templates or the corpus. `--check` remakes into a temporary folder and fails
# if anything differs from what the repository holds.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=target/tokenizer-venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import tokenizers, jinja2' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q 'tokenizers==0.23.3' 'jinja2==3.1.6'
fi
data=router/tests/data/tokenize
out=$data
if [ "${1:-}" = --check ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
  cp -r "$data/templates" "$data/cases.json" "$out/"
fi
"$venv/bin/python" scripts/tokenizer/make.py train "$out/tiny"
"$venv/bin/python" scripts/tokenizer/make.py expect "$out/tiny" "$data/cases.json" "$out/expected.json"
if [ "$out" != "$data" ]; then
  diff -r "$data/tiny" "$out/tiny" && diff "$data/expected.json" "$out/expected.json" && echo "tokenizer fixtures: as the repository holds them"
fi
