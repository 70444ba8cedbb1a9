"""Deployment benchmark: roll a new version to 3 CPU engine replicas under loopback load through
the gateway, with deltas and with full snapshots (the baseline), and measure the gateway's overhead.

Where the store is: by default where a fleet's store is, across a network. ``undertow weights
serve`` runs in its own network namespace behind a veth link shaped to 1 Gbit/s in both
directions (``--link-mbit``, :mod:`benchmarks.netlink`; needs root or CAP_NET_ADMIN, and where
the machine does not allow it the replicas read the store's directory, said on stderr and in
``store``), and every replica pulls over HTTP across it. ``--link-mbit 0``: the store's
directory on the local disk, where snapshot files sit in the page cache and reading one costs
about a memory copy, so the delta's advantage, the bytes pulled (``bytes_ratio``), goes
uncharged and the ratio stays near 1.

Model: the policy's ``medium`` preset by default (about 112M parameters, 224 MB per snapshot in
bf16, where moving weights is most of a rollout; ``--preset small``: 7.6M parameters, quick),
stored in the project's weight store (``policy.weights``) under the checkpoint's tensor names.

Each new version is made by the RL trainer (``--change trainer``, the default): a fresh optimizer
and ``--trainer-steps`` steps of :func:`policy.trainer.update_step` with the pipeline's settings
(:func:`policy.pipeline.train_config` of the default ``PolicyConfig``: GRPO, lr 3e-4, routing
replay), each on ``--tasks-per-step`` groups of the task family: a training task's concise,
verbose and first wrong reference solutions, rewarded by the sandboxed checker (1, 0.2, 0), with
the served version's own logprobs and routed experts. Left out, for time: sampling the
completions (a random-init ``medium`` model writes nothing the checker passes, so GRPO would have
no signal; the ``tiny`` policy's own sampled versions are in ``benchmarks/delta.py``) and the
pipeline's full step (4 steps of 8 tasks x 6 samples per version: about 2 minutes per step on this
CPU for ``medium``). Adam's first step from a fresh optimizer moves every weight that has a gradient by
about the learning rate whatever the batch, so the delta's density is a real version's:
``trainer.versions`` gives the share of bf16 weights each version changed. ``--change synthetic``:
the earlier synthetic change (4% of the entries of every tensor move), for comparison with older
figures.

``links``: the transfer and apply of v1 into one replica's weights (:class:`serving.weights.WeightUpdater`,
the engine's own, in this process once the fleet is stopped), by delta and by snapshot, with the
store on the local disk (files in the page cache), and across shaped links of 1 and 10 Gbit/s:
``transfer_apply_s`` (prefetch: transfer, checks, decode, staging; plus apply: the in-place
writes), its parts, ``effective_mbit_s`` (bytes over the prefetch time: where it stays under the
link's rate, the HTTP store server or the CPU is the bound, not the link), ``link_floor_s`` (the
bytes at the link's rate), ``bitexact`` and ``speedup`` (snapshot over delta).

A round is a delta rollout to an odd version (each replica pulls the delta, checks its
base checksums against the checksums it verified when it last loaded or applied weights,
decodes the changed positions, hashes every changed target tensor before the pause without
building it, then writes only the changed positions during a short pause), then a full rollout
to the next version (each replica reads the whole snapshot and hashes every tensor before the
pause, then writes every tensor). By default one round: the first updates after the engines
start; ``--rounds N`` runs N in a row, reports the last and lists all (``rounds``). Stages: a
canary of one replica, then half, then all (one replica per stage here), every replica pulling
ahead when the rollout starts; no gate is evaluated (no metrics source): the comparison is about
moving weights, and a gate's minimum sample would cost both kinds the same wait.

Fields: ``delta_rollout_s``, ``full_rollout_s``, ``speedup`` (full / delta), ``max_pause_ms``
(longest pause of a replica in the delta rollout), ``failed_requests`` (user requests through
the gateway that failed during all rollouts), ``gateway_overhead_ms_p50`` (p50 of gateway
minus direct latency for the same 1-token request), the bytes each replica pulled, and
``phases``: per kind, seconds summed over the 3 replicas for each step of the rollout
(``prefetch``: the pull RPC, with the engine's own split in ``engine_prefetch``; ``registry``;
``drain``: pausing until running requests finish; ``apply`` with ``engine_apply``; ``resume``)
and for the rollout as a whole (``setup``, ``finish``); ``weights_s`` is prefetch plus apply,
summed over replicas (the pulls overlap, so it exceeds the rollout's time), and
``weights_speedup`` its ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from policy.rollouts import Rollout
    from policy.tasks import Task

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


DEFAULT_LINK_MBIT = 1000
"""The store's link to the replicas by default: 1 Gbit/s, a common per-host share of a storage network."""


def training_step(tensors: dict[str, torch.Tensor], seed: int, frac: float = 0.04) -> dict[str, torch.Tensor]:
    """A step-like change: ``frac`` of the entries of each tensor (drawn with replacement) move by a
    few percent of their size; drawn at the changed positions only, so large models publish quickly."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        flat = t.float().reshape(-1).clone()
        count = int(torch.binomial(torch.tensor([float(flat.numel())]), torch.tensor([frac]), generator=gen).item())
        where = torch.randint(0, flat.numel(), (count,), generator=gen)
        moved = flat[where]
        flat[where] = moved + moved.abs().clamp_min(1e-3) * 0.05 * torch.randn(count, generator=gen)
        out[name] = flat.reshape(t.shape)
    return out


def synthetic_versions(tensors: dict[str, torch.Tensor], count: int) -> Iterator[dict[str, torch.Tensor]]:
    """``count`` versions, each :func:`training_step` of the one before."""
    for i in range(1, count + 1):
        tensors = training_step(tensors, seed=i)
        yield tensors


def make_checkpoint(root: Path, preset: str) -> tuple[Path, int]:
    """v0 of ``preset`` with the task family's tokenizer (so the trainer can train it), its fp32 weights
    rounded to bf16 (the store's serving dtype), as a Hugging Face checkpoint under ``root``."""
    from policy.model import build_model, num_parameters, save_checkpoint
    from policy.tokenizer import default_tokenizer

    tok = default_tokenizer()
    model = build_model(preset, len(tok), 0)
    with torch.no_grad():  # the served bits are bf16 (the store's serving dtype)
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return save_checkpoint(model, tok, root / "ckpt"), num_parameters(model)


def candidate_batch(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, tasks: list[Task], version: int
) -> list[Rollout]:
    """One GRPO group per task: its concise, verbose and first wrong reference solutions, rewarded by the
    sandboxed checker, with ``model``'s logprobs and routed experts as the served ones (the version it
    holds served them)."""
    import numpy as np

    from policy.checker import check_many
    from policy.forward import score_tokens
    from policy.rollouts import Rollout, task_reward
    from policy.sft import encode_example

    items = [(task, body) for task in tasks for body in (task.concise, task.verbose, *task.wrong[:1])]
    out = []
    for (task, body), result in zip(items, check_many(items), strict=True):
        ids, prompt_len = encode_example(tokenizer, task, body)
        scored = score_tokens(model, ids, prompt_len=prompt_len)
        out.append(
            Rollout(
                prompt_ids=ids[:prompt_len],
                completion_ids=ids[prompt_len:],
                reward=task_reward(result),
                served_logprobs=scored.logprobs.astype(np.float64),
                routed_experts=scored.routed_experts,
                group_id=task.task_id,
                context=task.task_id,
                policy_version=version,
            )
        )
    return out


def trainer_versions(
    checkpoint: Path, count: int, *, steps: int, tasks_per_step: int, info: dict[str, Any]
) -> Iterator[dict[str, torch.Tensor]]:
    """Versions 1..``count`` of ``checkpoint`` made by the RL trainer (yielded as fp32 state dicts, one at a
    time): per version a fresh optimizer and ``steps`` steps of :func:`policy.trainer.update_step` with
    :func:`policy.pipeline.train_config` of the default :class:`policy.config.PolicyConfig` (GRPO, lr
    3e-4, routing replay) on :func:`candidate_batch` groups of ``tasks_per_step`` training tasks.
    ``info`` receives each version's rewards, seconds and share of bf16 weights changed."""
    from dataclasses import replace

    from policy.config import PolicyConfig
    from policy.model import load_checkpoint
    from policy.pipeline import train_config
    from policy.trainer import make_optimizer, step_tasks, update_step
    from serving.params import ModelParams

    policy = PolicyConfig()
    model, tokenizer = load_checkpoint(checkpoint)
    params = ModelParams(model, checkpoint, threading.Lock())  # the store's names: one tensor per expert
    previous = {name: params.get(name).detach().to(torch.bfloat16) for name in params.names()}
    info.update(preset_checkpoint=str(checkpoint.name), steps_per_version=steps, tasks_per_step=tasks_per_step,
                candidates_per_task=3, lr=policy.rl_lr, advantage=policy.advantage, versions=[])  # fmt: skip
    for number in range(1, count + 1):
        started = time.perf_counter()
        cfg = replace(train_config(policy, steps), seed=policy.seed * 7919 + number)
        optimizer = make_optimizer(model, cfg)
        rewards: list[float] = []
        for step in range(steps):
            batch = candidate_batch(model, tokenizer, step_tasks(cfg.seed, step, tasks_per_step), number - 1)
            rewards += [r.reward for r in batch]
            update_step(model, optimizer, batch, cfg)
        state = {name: params.get(name).detach() for name in params.names()}
        current = {k: v.to(torch.bfloat16) for k, v in state.items()}
        changed = sum(int((current[k].view(torch.int16) != previous[k].view(torch.int16)).sum()) for k in current)
        total = sum(v.numel() for v in current.values())
        info["versions"].append(
            {"version": f"v{number}", "rewards": rewards, "changed_fraction": round(changed / total, 5),
             "seconds": round(time.perf_counter() - started, 1)}
        )  # fmt: skip
        previous = current
        yield state


class Load:
    """Closed-loop loopback clients through the gateway; counts failures."""

    def __init__(self, url: str, workers: int) -> None:
        self.url, self.ok, self.failed, self.stop = url, 0, 0, threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(workers)]

    def run(self) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                r = c.post(self.url + "/v1/completions", json={"prompt": "def add", "max_tokens": 2})
                if r.status_code == 200:
                    self.ok += 1
                else:
                    self.failed += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


@contextlib.contextmanager
def remote_store(root: Path, mbit: int) -> Iterator[str]:
    """``root / "store"`` served by ``undertow weights serve`` in a network namespace behind a
    shaped link (:mod:`benchmarks.netlink`); yields the URL the replicas pull from."""
    from benchmarks import netlink
    from ingest.embedded import free_port

    with netlink.shaped_link(mbit) as link:
        port = free_port()
        env = {**os.environ, "UNDERTOW_HOME": str(root / "store-home")}
        cmd = [sys.executable, "-m", "scheduler.cli", "weights", "serve", "--root", str(root / "store")]
        cmd += ["--host", link.peer_ip, "--port", str(port)]
        server = subprocess.Popen(link.command(cmd), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://{link.peer_ip}:{port}/"
        try:
            deadline = time.monotonic() + 60
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"the store server exited: {server.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
                try:
                    httpx.get(url + "-/health", timeout=2).raise_for_status()
                    break
                except httpx.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            yield url
        finally:
            server.terminate()
            server.wait(10)


LINKS_MBIT = (0, 1000, 10_000)
"""Where ``links`` pulls from: the local directory (0), then the store across 1 and 10 Gbit/s links."""


def link_transfer(
    store_url: str,
    held: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
    *,
    to_version: str,
    expected_hash: str,
    kind: str,
    public_key: Path | None,
) -> dict[str, Any]:
    """One replica's update from ``held`` (version ``v0``) to ``to_version`` through ``kind`` (``delta`` or
    ``snapshot``): :class:`serving.weights.WeightUpdater`, the engine's own, on a copy of ``held`` in the
    engines' dtype, pulling from ``store_url``. ``transfer_apply_s`` is prefetch (transfer, checks,
    decode, staging) plus apply (the in-place writes); ``bitexact``: the result equals ``target`` (the
    store's bits) bit for bit."""
    from serving.protocol import ApplyRequest, PrefetchRequest
    from serving.weights import WeightUpdater

    live = {k: v.float().clone() for k, v in held.items()}
    updater = WeightUpdater.for_dict(live, version="v0", store_url=store_url, public_key=public_key)
    started = time.perf_counter()
    pulled = updater.prefetch(PrefetchRequest(to_version=to_version, kind=kind))
    prefetched = time.perf_counter()
    updater.apply(ApplyRequest(to_version=to_version, expected_hash=expected_hash))
    done = time.perf_counter()
    updater.settle()
    exact = all(torch.equal(live[k].to(torch.bfloat16).view(torch.int16), target[k].view(torch.int16)) for k in target)
    nbytes = int(pulled["bytes"])
    return {
        "bytes": nbytes,
        "transfer_apply_s": round(done - started, 3),
        "prefetch_s": round(prefetched - started, 3),
        "apply_s": round(done - prefetched, 3),
        "effective_mbit_s": round(nbytes * 8 / (prefetched - started) / 1e6, 1),
        "bitexact": exact,
    }


def link_figures(root: Path, v0: Path, to_version: str, expected_hash: str, public_key: Path) -> dict[str, Any]:
    """:func:`link_transfer` of ``to_version`` by delta and by snapshot, for each of :data:`LINKS_MBIT`
    (the shaped links only where the machine allows network namespaces; ``skipped`` says why not)."""
    from safetensors.torch import load_file

    from benchmarks import netlink
    from policy.weights import WeightStore

    held = load_file(str(v0 / "model.safetensors"))
    target = WeightStore(root / "store").state_dict(to_version)
    missing = netlink.available()
    out: dict[str, Any] = {"version": to_version}
    for mbit in LINKS_MBIT:
        name = f"{mbit // 1000}gbit" if mbit else "local"
        if mbit and missing:
            out[name] = {"skipped": missing}
            continue
        with remote_store(root, mbit) if mbit else contextlib.nullcontext(str(root / "store")) as url:
            kinds = {
                label: link_transfer(url, held, target, to_version=to_version, expected_hash=expected_hash,
                                     kind=kind, public_key=public_key)
                for label, kind in (("delta", "delta"), ("full", "snapshot"))
            }  # fmt: skip
        row: dict[str, Any] = {"link_mbit": mbit or None, **kinds}
        row["speedup"] = round(kinds["full"]["transfer_apply_s"] / kinds["delta"]["transfer_apply_s"], 2)
        if mbit:
            for figures in kinds.values():
                figures["link_floor_s"] = round(figures["bytes"] * 8 / (mbit * 1e6), 3)
        out[name] = row
    return out


def phase_totals(result: Any) -> dict[str, Any]:
    """Seconds per rollout step, summed over replicas (engine-side phases nested), plus the rollout's own."""
    totals: dict[str, Any] = {"engine_prefetch": {}, "engine_apply": {}}
    for replica, times in result.phases.items():
        if replica == "rollout":
            continue
        for key, value in times.items():
            if isinstance(value, dict):
                for phase, seconds in value.items():
                    totals[key][phase] = totals[key].get(phase, 0.0) + seconds
            elif value is not None:
                totals[key] = totals.get(key, 0.0) + value
    totals["weights_s"] = totals.get("prefetch", 0.0) + totals.get("apply", 0.0)
    totals.update(result.phases.get("rollout", {}))
    return _rounded(totals)


def _rounded(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    return round(obj, 4) if isinstance(obj, float) else obj


def main() -> None:
    from serving.config import DeployConfig

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--workers", type=int, default=2, help="concurrent load clients")
    parser.add_argument("--preset", default="medium", help="policy preset of the served model (small: quick)")
    parser.add_argument("--logs", default=None, help="directory for the engines' logs")
    parser.add_argument(
        "--link-mbit",
        type=int,
        default=None,
        help="serve the store across a network link of this many Mbit/s (a network namespace; root or "
        f"CAP_NET_ADMIN; default {DEFAULT_LINK_MBIT} where the machine allows it); 0: the replicas read the "
        "store's directory",
    )
    parser.add_argument(
        "--pulls",
        type=int,
        default=DeployConfig().prefetch_concurrency,
        help="replicas pulling at once (serving.deploy.prefetch_concurrency)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="pairs of rollouts (delta, then snapshot) in a row; the last pair is reported, all are listed",
    )
    parser.add_argument(
        "--change",
        choices=("trainer", "synthetic"),
        default="trainer",
        help="what makes each new version: the RL trainer (default) or the earlier synthetic 4%% change",
    )
    parser.add_argument("--trainer-steps", type=int, default=1, help="trainer steps per version (--change trainer)")
    parser.add_argument("--tasks-per-step", type=int, default=2, help="task groups per trainer step")
    parser.add_argument("--no-links", action="store_true", help="skip the local / 1 / 10 Gbit/s comparison")
    args = parser.parse_args()
    if args.trainer_steps < 1 or args.tasks_per_step < 1:
        raise SystemExit("--trainer-steps and --tasks-per-step must be at least 1")
    from benchmarks import netlink

    missing = netlink.available()
    if args.link_mbit is None:
        args.link_mbit = 0 if missing else DEFAULT_LINK_MBIT
        if missing:
            print(f"no network namespace here ({missing}): the replicas read the store's directory", file=sys.stderr)
    elif args.link_mbit and missing:
        raise SystemExit(f"--link-mbit needs a network namespace: {missing}. Run with --link-mbit 0.")
    torch.set_num_threads(2)  # publishing; the engines serve with one thread each
    started = time.perf_counter()

    from safetensors.torch import load_file

    from ingest.db import make_engine, upgrade
    from ingest.embedded import free_ports
    from policy.config import WeightsConfig
    from policy.weights import SigningKey, WeightStore
    from serving import fleet
    from serving.config import FleetConfig, GatewayConfig
    from serving.deploy import rollout
    from serving.gateway import Gateway, create_gateway_app, registry_source
    from serving.launch import EngineProcess, ServerThread

    logs = Path(args.logs) if args.logs else None
    rounds: list[tuple[Any, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ckpt, n_params = make_checkpoint(root, args.preset)
        signer = SigningKey(root / "keys" / "weights.pem", root / "keys" / "weights.pub")
        store = WeightStore(root / "store", WeightsConfig(zstd_level=3), signer=signer)
        token = secrets.token_urlsafe(32)
        fleet_cfg = FleetConfig(unhealthy_after=1, control_token=token)
        hashes = {"v0": store.put(ckpt, version="v0", full=True).version_hash}
        stack = contextlib.ExitStack()
        store_url = stack.enter_context(remote_store(root, args.link_mbit)) if args.link_mbit else str(root / "store")
        # Replicas boot (in parallel) while the next versions are published.
        ports = free_ports(3)
        procs = [
            EngineProcess(
                ckpt,
                "v0",
                store_url,
                port=ports[i],
                log_path=logs / f"engine-{i}.log" if logs else None,
                control_token=token,
                public_key=signer.public_path,
            ).start()
            for i in range(3)
        ]
        trainer: dict[str, Any] = {}
        try:
            if args.change == "trainer":
                made = trainer_versions(
                    ckpt, 2 * args.rounds, steps=args.trainer_steps, tasks_per_step=args.tasks_per_step, info=trainer
                )
            else:
                made = synthetic_versions(load_file(str(ckpt / "model.safetensors")), 2 * args.rounds)
            for i, state in enumerate(made, start=1):
                # A snapshot where a full rollout goes (even versions) and of v1 (``links`` pulls it both
                # ways); every version has its delta.
                hashes[f"v{i}"] = store.put(state, version=f"v{i}", full=i % 2 == 0 or i == 1).version_hash
            del made
            for p in procs:
                p.wait_ready(timeout_s=300)
            url = f"sqlite:///{root / 'db.sqlite'}"
            upgrade(url)
            db = make_engine(url)
            for i, p in enumerate(procs):
                fleet.register_replica(db, f"r{i}", p.url)
            fleet.set_target(db, "v0", hashes["v0"])
            asyncio.run(fleet.check_fleet(db, fleet_cfg))
            gw = Gateway(registry_source(db, "default", 0.2), None, GatewayConfig(), "undertow-policy")
            cfg = DeployConfig(canary_replicas=1, stages=[0.5, 1.0], prefetch_concurrency=args.pulls)
            with ServerThread(create_gateway_app(gw)) as srv:
                body = {"prompt": "def", "max_tokens": 1, "temperature": 0}
                direct, via = [], []
                with httpx.Client(timeout=60) as c:
                    for _ in range(20):
                        t0 = time.perf_counter()
                        c.post(procs[0].url + "/v1/completions", json=body)
                        direct.append((time.perf_counter() - t0) * 1000)
                        t0 = time.perf_counter()
                        c.post(srv.url + "/v1/completions", json=body)
                        via.append((time.perf_counter() - t0) * 1000)
                overhead = statistics.median(via) - statistics.median(direct)
                with Load(srv.url, args.workers) as load:
                    time.sleep(0.3)
                    for r in range(args.rounds):
                        odd, even = f"v{2 * r + 1}", f"v{2 * r + 2}"
                        delta = asyncio.run(rollout(db, odd, hashes[odd], cfg, kind="delta", fleet_config=fleet_cfg))
                        full = asyncio.run(
                            rollout(db, even, hashes[even], cfg, kind="snapshot", fleet_config=fleet_cfg)
                        )
                        rounds.append((delta, full))
                    time.sleep(0.2)
        finally:
            for p in procs:
                p.kill()
            stack.close()
        manifests = {m.version: m for m in store.manifests()}
        links = None if args.no_links else link_figures(root, ckpt, "v1", hashes["v1"], root / "keys" / "weights.pub")
    delta, full = rounds[-1]
    last = 2 * args.rounds
    phases = {"delta": phase_totals(delta), "full": phase_totals(full)}
    result = {
        "delta_rollout_s": round(delta.seconds, 3),
        "full_rollout_s": round(full.seconds, 3),
        "speedup": round(full.seconds / delta.seconds, 2),
        "weights_speedup": round(phases["full"]["weights_s"] / phases["delta"]["weights_s"], 2),
        "max_pause_ms": round(max(delta.pause_ms.values()), 1),
        "max_pause_ms_full": round(max(full.pause_ms.values()), 1),
        "delta_bytes_per_replica": max(delta.pulled_bytes.values()),
        "snapshot_bytes_per_replica": max(full.pulled_bytes.values()),
        "bytes_ratio": round(manifests[f"v{last}"].full.bytes / manifests[f"v{last - 1}"].delta.bytes, 1),  # type: ignore[union-attr]
        "failed_requests": load.failed,
        "served_requests": load.ok,
        "gateway_overhead_ms_p50": round(overhead, 2),
        "statuses": [r.status for pair in rounds for r in pair],
        "rounds": [
            {
                "delta_rollout_s": round(d.seconds, 3),
                "full_rollout_s": round(f.seconds, 3),
                "speedup": round(f.seconds / d.seconds, 2),
                "max_pause_ms": round(max(d.pause_ms.values()), 1),
            }
            for d, f in rounds
        ],
        "phases": phases,
        "gate": "none (no metrics source): both kinds would wait the same for a gate's minimum sample",
        "model": f"{args.preset} preset, {n_params} parameters, bf16 in the store, fp32 in the engines",
        "store": (
            f"HTTP (undertow weights serve) across a {args.link_mbit} Mbit/s veth link shaped by tc tbf"
            if args.link_mbit
            else "local filesystem, files in the page cache (no network between store and replicas)"
        ),
        "link_mbit": args.link_mbit or None,
        "change": args.change,
        "trainer": trainer or None,
        "links": links,
        "total_s": round(time.perf_counter() - started, 1),
        "note": "3 CPU engine replicas, the gateway and the load clients share the machine; single runs are noisy",
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
