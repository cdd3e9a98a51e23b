"""Makes the tiny model's tokenizer and the router's tokenization fixtures, with Hugging Face's
own Python `tokenizers` and Jinja2 (nothing is downloaded but the two packages):

  train   DIR: a byte-level BPE of 1,024 tokens (the tiny model's vocabulary), trained on
          router/tests/data/tokenize/corpus.md (three of the repository's docs), with `<s>`
          added in front of an encoded prompt (as Llama's tokenizer does) and a ChatML chat
          template, into DIR/tokenizer.json and DIR/tokenizer_config.json;
  expect  DIR CASES OUT: for every case of CASES (JSON), the chat template rendered as Hugging
          Face renders it (Jinja2 with trim_blocks, lstrip_blocks, loop controls, its tojson,
          raise_exception) and the token ids DIR's tokenizer gives, into OUT.

The router's tests (router/tests/tokenize.rs) read OUT and must give the same texts and ids.
"""
import json
import os
import sys

SPECIAL = ["<s>", "</s>", "<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]


def train(out):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    files = [os.path.join(root, "router", "tests", "data", "tokenize", "corpus.md")]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    template_path = os.path.join(root, "router", "tests", "data", "tokenize", "templates", "chatml.jinja")
    with open(template_path) as f:
        template = f.read()
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({k: config[k] for k in ["bos_token", "eos_token", "unk_token", "pad_token"]}, f, indent=2)
        f.write("\n")
    print(f"tokenizer: {tok.get_vocab_size()} tokens from {len(files)} files into {out}", file=sys.stderr)


def environment():
    """The Jinja2 environment chat templates are rendered in, as Hugging Face sets it."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def expect(tokenizer_dir, cases_path, out):
    import jinja2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json")) as f:
        config = json.load(f)
    special = {k: config[k] for k in ["bos_token", "eos_token", "unk_token", "pad_token"] if k in config}
    with open(cases_path) as f:
        cases = json.load(f)
    templates_dir = os.path.join(os.path.dirname(cases_path), "templates")
    env = environment()
    result = {"encode": [], "chat": []}
    for c in cases["encode"]:
        ids = tok.encode(c["text"], add_special_tokens=c["add_special_tokens"]).ids
        result["encode"].append({**c, "ids": ids})
    for c in cases["chat"]:
        with open(os.path.join(templates_dir, c["template"])) as f:
            template = env.from_string(f.read())
        req = c["request"]
        ctx = dict(req.get("chat_template_kwargs") or {})
        ctx.update(special)
        ctx.update(
            messages=req["messages"],
            tools=req.get("tools"),
            documents=req.get("documents"),
            add_generation_prompt=req.get("add_generation_prompt", True),
        )
        try:
            text = template.render(**ctx)
        except jinja2.exceptions.TemplateError as e:
            result["chat"].append({**c, "error": str(e)})
            continue
        ids = tok.encode(text, add_special_tokens=False).ids
        result["chat"].append({**c, "text": text, "ids": ids})
    with open(out, "w") as f:
        json.dump(result, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"expected: {len(result['encode'])} encodings, {len(result['chat'])} chats into {out}", file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:2] == ["train"] and len(sys.argv) == 3:
        train(sys.argv[2])
    elif sys.argv[1:2] == ["expect"] and len(sys.argv) == 5:
        expect(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(__doc__)
