"""Serve a model behind an OpenAI-compatible API, as replicas on Ray.

    python launch.py --model PATH_OR_HF_ID [--tp-size K] [--replicas N] [--host 127.0.0.1] [--port 8000]
                     [--config configs/X.yaml] [--address auto]
    python launch.py --demo        # a tiny random model, no network needed (its output is meaningless)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields
from pathlib import Path

from cluster.config import ServeConfig

DEMO_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "raylm" / "demo-model"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", help="a serving YAML from configs/; flags override it")
    p.add_argument("--demo", action="store_true", help="serve a tiny random model built locally (meaningless output)")
    for f in fields(ServeConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            kind = {"int": int, "float": float, "int | None": int, "float | None": float}.get(str(f.type), str)
            p.add_argument(flag, dest=f.name, type=kind, default=None)
    p.add_argument("--metrics-export-port", type=int, default=None,
                   help="where Ray exports the replicas' metrics for Prometheus to scrape")
    p.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=True,
                   help="start the Ray dashboard with the local Ray this command starts (on by default)")
    return p.parse_args(argv)


def resolve_model(model: str) -> str:
    """A local folder as is; otherwise a Hugging Face id, downloaded with progress."""
    if Path(model).exists():
        return model
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except Exception as e:  # noqa: BLE001 - offline, unknown id, gated model...
        sys.exit(f"cannot find '{model}' locally or fetch it from the Hugging Face hub ({type(e).__name__}: {e}).\n"
                 f"Give a local model folder (config.json, *.safetensors, tokenizer files), or download it first "
                 f"on a machine with network: huggingface-cli download {model} --local-dir DIR")


def build_config(args: argparse.Namespace) -> ServeConfig:
    config = ServeConfig.from_yaml(args.config) if args.config else ServeConfig()
    given = {f.name: getattr(args, f.name) for f in fields(ServeConfig) if getattr(args, f.name) is not None}
    config = config.override(**given)
    if args.demo:
        from cluster.tiny_model import build_checkpoint
        if not (DEMO_DIR / "config.json").exists():
            build_checkpoint("qwen3", DEMO_DIR)
        config = config.override(model=str(DEMO_DIR), served_model_name=config.served_model_name or "demo")
    elif config.model:
        config = config.override(model=resolve_model(config.model))
    return config


def local_ray_options(dashboard: bool = True) -> dict:
    """Options for the Ray this command starts: with the dashboard where Ray's dashboard packages are
    installed (`ray[default]`); without it, and a note, where they are not (Ray refuses to start when
    asked for a dashboard it cannot run)."""
    if not dashboard:
        return {"include_dashboard": False}
    missing = dashboard_dependency_error()
    if missing is not None:
        print(f"Ray dashboard off: its packages are missing ({missing}); install 'ray[default]' for it",
              file=sys.stderr, flush=True)
        return {"include_dashboard": False}
    return {"include_dashboard": True, "dashboard_host": "127.0.0.1"}


def dashboard_dependency_error() -> ImportError | None:
    try:
        import ray.dashboard.optional_deps  # noqa: F401 - what Ray itself imports to decide
    except ImportError as e:
        return e
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = build_config(args)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config.validate()
    except ValueError as e:
        sys.exit(str(e))
    from router.server import Server
    ray_options = local_ray_options(args.dashboard) if config.address is None else {}
    if args.metrics_export_port is not None and config.address is None:
        ray_options["_metrics_export_port"] = args.metrics_export_port
    server = Server(config, **ray_options)
    dashboard = server.dashboard_url
    print(f"OpenAI-compatible API: {server.url}/v1  (model '{server.state.model_name}', "
          f"{config.replicas} replica(s) x tp {config.tp_size})", flush=True)
    if dashboard:
        print(f"Ray dashboard: {dashboard if dashboard.startswith('http') else 'http://' + dashboard}", flush=True)
    if args.metrics_export_port is not None:
        print(f"Prometheus: scrape {server.url}/metrics (router) and port {args.metrics_export_port} (Ray)",
              flush=True)
    server.run()


if __name__ == "__main__":
    main()
