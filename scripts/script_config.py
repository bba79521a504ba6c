"""The configuration arguments shared by the course's one-off scripts (the range test, the
scaling study, the overlap timing): which configuration, from which YAML file, with which data
and output root, loaded with the project's checks (a bad value stops in one line)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from utils.config import Config


def add_config_args(p: argparse.ArgumentParser, default: str = "tiny", outputs: bool = True) -> None:
    """--config and --yaml_config; with ``outputs`` also --data_dir and --expdir."""
    p.add_argument("--config", default=default)
    p.add_argument("--yaml_config", default=None,
                   help="YAML file of configurations (default config/ViT.yaml)")
    if outputs:
        p.add_argument("--expdir", type=Path, default=None,
                       help="root of the outputs (default: the config's expdir)")
        p.add_argument("--data_dir", default=None, help="the data (default: the config's)")


def load_script_config(p: argparse.ArgumentParser, args: argparse.Namespace, **overrides: Any) -> Config:
    """The named configuration with --data_dir (when given) and ``overrides`` applied; a bad
    name or value ends the script with argparse's one-line error."""
    from utils.config import DEFAULT_YAML, load_config, with_overrides

    try:
        cfg = load_config(args.yaml_config or DEFAULT_YAML, args.config)
        data_dir = getattr(args, "data_dir", None)
        return with_overrides(cfg, **({"data_dir": data_dir} if data_dir else {}), **overrides)
    except ValueError as err:
        p.error(str(err))
