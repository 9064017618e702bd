"""python -m data.tfds_avamerg --manual-dir RAW --data-dir DIR [--encoder NAME --encoder-arg K=V ...]"""

from __future__ import annotations

import argparse
import json
import sys

from data.tfds_avamerg import AvamergConfig, build


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.tfds_avamerg", description=__doc__)
    ap.add_argument("--manual-dir", required=True, help="AvaMERG {split}.json + media/ (+ targets/)")
    ap.add_argument("--data-dir", required=True, help="TFDS data_dir to write avamerg/<config>/1.0.0 into")
    ap.add_argument("--encoder", default="lite")
    ap.add_argument("--encoder-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--config-name", default=None, help="config name (default: the encoder name)")
    ap.add_argument("--skip-invalid", action="store_true")
    args = ap.parse_args(argv)
    kwargs = {}
    for item in args.encoder_arg:
        key, _, value = item.partition("=")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    name = args.config_name or args.encoder.replace("+", "_")
    if name == "lite" and not kwargs and not args.skip_invalid and args.encoder == "lite":
        config: AvamergConfig | str = "lite"
    else:
        config = AvamergConfig(
            name=name, encoder=args.encoder, encoder_kwargs=kwargs, skip_invalid=args.skip_invalid
        )
    b = build(args.manual_dir, args.data_dir, config)
    counts = {s: v.num_examples for s, v in b.info.splits.items()}
    print(f"built {b.info.full_name} into {b.data_dir}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
