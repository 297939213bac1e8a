"""`ds4-agent`: the coding agent. The TUI lands with the agent issue; until then this validates the
model it would load and says what is missing."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ds4-agent", description="a native coding agent for DeepSeek V4 Flash")
    p.add_argument("-m", "--model", help="path to a ds4 GGUF")
    p.add_argument("--serve", action="store_true", help="run the HTTP shim instead of the TUI")
    a = p.parse_args(argv)
    if a.model:
        from engine import ModelFile, ModelFileError
        try:
            with ModelFile.open(a.model) as m:
                print(f"{m.path}: valid DeepSeek V4 model ({m.config.n_layer} layers, recipe {m.recipe})")
        except ModelFileError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    what = "the HTTP shim" if a.serve else "the agent TUI"
    print(f"ds4-agent: {what} is not built yet; for now `ds4-gguf synth` / `ds4-gguf inspect` "
          f"write and check model files.", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
