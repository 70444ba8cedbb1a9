"""The coding task family: small Python functions with a spec and hidden unit tests, in tiers.

Every task asks for the body of ``def f(...)`` from a one-line spec. Each has hidden tests
(inputs and expected outputs computed from the reference), a concise reference solution, a
correct-but-verbose one and plausible wrong ones, and a size limit: a candidate is *kept*
("pass-and-keep", the product's notion of a response a user keeps) when it passes every test
and its body is at most ``size_limit`` characters, which the concise form meets and the
verbose form does not.

Tiers (difficulty grows with the number of parts to get right at once):

1. arithmetic on one number: ``return x * 3 + 2`` (operators and constants to copy);
2. filter-and-aggregate over a list: ``return sum(x * 2 for x in xs if x > 4)``
   (aggregate, transform, predicate);
3. edge cases: ``return max((x for x in xs if x % 3 == 0), default=-1)`` (the empty case is
   tested; the plausible wrong answer forgets it).

About 2,400 tasks from 66 templates. A template is a spec's pattern with its constants as slots
(``t1/plus-times``: ``return x plus {a} times {b}``; ``t2/list/square/divisible``: a list of the
squares of the numbers divisible by ``{k}``; ``t3/first/parity``). The held-out split is whole
templates (those whose key hashes to 0 mod 8: 10 templates, about 14% of the tasks, every tier),
so a held-out task is a combination of parts the policy has seen (a list comprehension, a
divisibility test) in a pattern it never trained on, not a sibling of a training task with other
constants. Nothing is trained on it, the tokenizer included (:func:`tokenizer_corpus`);
:func:`heldout_eval_set` is the fixed subset the evaluator uses.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from functools import cache
from typing import Any

PROMPT_TEMPLATE = "# {spec}\n{signature}\n"
HELDOUT_MOD = 8


@dataclass(frozen=True)
class Task:
    """One function-writing task; ``tests`` hold ``(args, expected)`` pairs."""

    task_id: str
    tier: int
    spec: str
    signature: str
    tests: tuple[tuple[tuple[Any, ...], Any], ...]
    concise: str
    verbose: str
    wrong: tuple[str, ...]
    size_limit: int
    template: str = ""
    """The spec's pattern (see the module docstring); the held-out split is by template."""

    @property
    def prompt(self) -> str:
        """The text the policy continues (no BOS; callers prepend one)."""
        return PROMPT_TEMPLATE.format(spec=self.spec, signature=self.signature)

    @property
    def heldout(self) -> bool:
        """True for the fixed held-out split: the tasks of held-out templates (never trained on)."""
        return template_heldout(self.template)


def template_heldout(template: str) -> bool:
    """Whether a template is held out (its key's hash is 0 mod :data:`HELDOUT_MOD`)."""
    return int(hashlib.sha256(template.encode()).hexdigest(), 16) % HELDOUT_MOD == 0


OPS = {"plus": "+", "minus": "-", "times": "*"}
PREDICATES: list[tuple[str, str]] = [("that are even", "x % 2 == 0"), ("that are odd", "x % 2 == 1")]
PREDICATES += [(f"greater than {k}", f"x > {k}") for k in range(0, 10)]
PREDICATES += [(f"less than {k}", f"x < {k}") for k in range(0, 10)]
PREDICATES += [(f"divisible by {k}", f"x % {k} == 0") for k in range(3, 10)]
TRANSFORMS: list[tuple[str, str]] = [("", "x"), ("the squares of ", "x * x")]
TRANSFORMS += [(f"{k} times ", f"x * {k}") for k in range(2, 6)]
TRANSFORMS += [(f"{k} plus ", f"x + {k}") for k in range(1, 4)]


def _pfam(pword: str) -> str:
    """A predicate's family (its template slot): parity, greater, less or divisible."""
    if pword in ("that are even", "that are odd"):
        return "parity"
    return pword.split()[0]


def _tfam(tword: str) -> str:
    """A transform's family: plain, square, times or plus."""
    if not tword:
        return "plain"
    return "square" if "squares" in tword else tword.split()[1]


def _body(lines: list[str]) -> str:
    return "".join(f"    {line}\n" for line in lines)


def _wrong_predicates(pred: str) -> list[str]:
    """Plausible mistakes in a predicate: off-by-one comparison, flipped sense, wrong constant."""
    out = []
    if ">" in pred:
        out += [pred.replace(">", ">="), pred.replace(">", "<")]
    if "<" in pred:
        out += [pred.replace("<", "<="), pred.replace("<", ">")]
    if "==" in pred:
        out += [pred.replace("==", "!=")]
    digits = [c for c in pred if c.isdigit()]
    if digits:
        d = digits[-1]
        out.append(pred[: pred.rindex(d)] + str((int(d) + 1) % 10) + pred[pred.rindex(d) + 1 :])
    return out


def _tier1() -> list[dict[str, Any]]:
    out = []
    for w1, o1 in OPS.items():
        for w2, o2 in OPS.items():
            for a in range(1, 10):
                for b in range(1, 10):
                    expr = f"x {o1} {a} {o2} {b}"
                    spec = f"return x {w1} {a} {w2} {b}"
                    sequential = _body([f"y = x {o1} {a}", f"y = y {o2} {b}", "return y"])
                    verbose = sequential
                    if o2 == "*" and o1 != "*":
                        verbose = _body([f"y = {a} * {b}", f"y = x {o1} y", "return y"])
                    wrong = [f"x {o1} {a} {o3} {b}" for o3 in OPS.values() if o3 != o2]
                    wrong += [f"x {o1} {b} {o2} {a}", f"x {o1} ({a} {o2} {b})"]
                    raw = dict(tier=1, spec=spec, sig="def f(x):", expr=expr, verbose=verbose, wrong=wrong)
                    out.append({**raw, "template": f"t1/{w1}-{w2}"})
                    expr = f"(x {o1} {a}) {o2} {b}"
                    spec = f"return x {w1} {a}, then {w2} {b}"
                    wrong = [f"x {o1} {a} {o2} {b}", f"(x {o1} {b}) {o2} {a}"]
                    wrong += [f"(x {o1} {a}) {o3} {b}" for o3 in OPS.values() if o3 != o2]
                    raw = dict(tier=1, spec=spec, sig="def f(x):", expr=expr, verbose=sequential, wrong=wrong)
                    out.append({**raw, "template": f"t1/{w1}-then-{w2}"})
    return out


def _tier2() -> list[dict[str, Any]]:
    out = []
    for agg in ("sum", "count"):
        for tword, texpr in TRANSFORMS if agg == "sum" else TRANSFORMS[:1]:
            for pword, pred in PREDICATES:
                item = "1" if agg == "count" else texpr
                spec = (
                    f"return the sum of {tword}the numbers in xs {pword}"
                    if agg == "sum"
                    else f"return how many numbers in xs are {pword.removeprefix('that are ')}"
                )
                expr = f"sum({item} for x in xs if {pred})"
                acc = "total += 1" if agg == "count" else f"total += {texpr}"
                verbose = _body(["total = 0", "for x in xs:", f"    if {pred}:", f"        {acc}", "return total"])
                wrong = [f"sum({item} for x in xs if {w})" for w in _wrong_predicates(pred)]
                wrong.append(f"sum({item} for x in xs)")
                if agg == "sum" and texpr != "x":
                    wrong.append(f"sum(x for x in xs if {pred})")
                template = f"t2/sum/{_tfam(tword)}/{_pfam(pword)}" if agg == "sum" else f"t2/count/{_pfam(pword)}"
                raw = dict(tier=2, spec=spec, sig="def f(xs):", expr=expr, verbose=verbose, wrong=wrong)
                out.append({**raw, "template": template})
    for tword, texpr in TRANSFORMS:
        for pword, pred in PREDICATES:
            spec = f"return a list of {tword}the numbers in xs {pword}"
            expr = f"[{texpr} for x in xs if {pred}]"
            verbose = _body(
                ["out = []", "for x in xs:", f"    if {pred}:", f"        out.append({texpr})", "return out"]
            )
            wrong = [f"[{texpr} for x in xs if {w}]" for w in _wrong_predicates(pred)]
            wrong.append(f"[{texpr} for x in xs]")
            raw = dict(tier=2, spec=spec, sig="def f(xs):", expr=expr, verbose=verbose, wrong=wrong)
            out.append({**raw, "template": f"t2/list/{_tfam(tword)}/{_pfam(pword)}"})
    return out


def _tier3() -> list[dict[str, Any]]:
    out = []
    for agg, word in (("max", "largest"), ("min", "smallest")):
        cmp = ">" if agg == "max" else "<"
        for pword, pred in PREDICATES:
            for d in (-1, 0, 10, 100):
                spec = f"return the {word} number in xs {pword.removeprefix('that are ')}, or {d} if there is none"
                expr = f"{agg}((x for x in xs if {pred}), default={d})"
                verbose = _body(
                    [
                        "best = None",
                        "for x in xs:",
                        f"    if {pred} and (best is None or x {cmp} best):",
                        "        best = x",
                        f"return {d} if best is None else best",
                    ]
                )
                wrong = [f"{agg}(x for x in xs if {pred})", f"{agg}((x for x in xs), default={d})"]
                wrong += [f"{agg}((x for x in xs if {w}), default={d})" for w in _wrong_predicates(pred)]
                raw = dict(tier=3, spec=spec, sig="def f(xs):", expr=expr, verbose=verbose, wrong=wrong)
                out.append({**raw, "template": f"t3/{agg}/{_pfam(pword)}"})
    for pword, pred in PREDICATES:
        for default in (-1, 0, 10, None):
            spec = f"return the first number in xs {pword.removeprefix('that are ')}, or {default} if there is none"
            expr = f"next((x for x in xs if {pred}), {default})"
            verbose = _body(["for x in xs:", f"    if {pred}:", "        return x", f"return {default}"])
            wrong = [f"next(x for x in xs if {pred})", f"next((x for x in xs), {default})"]
            wrong += [f"next((x for x in xs if {w}), {default})" for w in _wrong_predicates(pred)]
            raw = dict(tier=3, spec=spec, sig="def f(xs):", expr=expr, verbose=verbose, wrong=wrong)
            out.append({**raw, "template": f"t3/first/{_pfam(pword)}"})
    return out


def _run(signature: str, body: str, args: tuple[Any, ...]) -> Any:
    """Evaluate trusted reference code in-process (generation only; candidates go to the checker)."""
    ns: dict[str, Any] = {}
    exec(f"{signature}\n{body}", ns)
    return ns["f"](*args)


def _inputs(tier: int, rng: random.Random) -> list[tuple[Any, ...]]:
    if tier == 1:
        return [(x,) for x in rng.sample(range(-20, 21), 6)]
    lists: list[tuple[Any, ...]] = [([],)] if tier == 3 else []
    lists += [([rng.randint(-9, 9) for _ in range(rng.randint(1, 8))],) for _ in range(8)]
    lists.append(([rng.randint(-9, 9) for _ in range(12)],))
    return lists


def _build(raw: dict[str, Any]) -> Task:
    rng = random.Random(raw["spec"])
    sig = raw["sig"]
    concise = _body([f"return {raw['expr']}"])
    tests = []
    for args in _inputs(raw["tier"], rng):
        tests.append((args, _run(sig, concise, args)))
    wrong = []
    for w in dict.fromkeys(raw["wrong"]):
        body = _body([f"return {w}"])
        try:
            fails = any(_run(sig, body, args) != expected for args, expected in tests)
        except Exception:
            fails = True
        if fails:
            wrong.append(body)
    digest = hashlib.sha256(raw["spec"].encode()).hexdigest()[:12]
    return Task(
        task_id=f"t{raw['tier']}-{digest}",
        tier=raw["tier"],
        spec=raw["spec"],
        signature=sig,
        tests=tuple(tests),
        concise=concise,
        verbose=raw["verbose"],
        wrong=tuple(wrong),
        size_limit=len(concise) + 4,
        template=raw["template"],
    )


@cache
def all_tasks() -> tuple[Task, ...]:
    """Every task of the family, in a fixed order (deterministic)."""
    return tuple(_build(raw) for raw in _tier1() + _tier2() + _tier3())


def train_tasks() -> list[Task]:
    """Tasks RL and the warm-up may train on."""
    return [t for t in all_tasks() if not t.heldout]


def heldout_tasks() -> list[Task]:
    """The fixed held-out split; never trained on."""
    return [t for t in all_tasks() if t.heldout]


def heldout_eval_set(per_tier: int = 32) -> list[Task]:
    """A fixed, tier-balanced subset of the held-out split for quick evaluation."""
    out: list[Task] = []
    for tier in (1, 2, 3):
        tasks = [t for t in heldout_tasks() if t.tier == tier]
        out += sorted(tasks, key=lambda t: t.task_id)[:per_tier]
    return out


def task_by_id(task_id: str) -> Task:
    """Look a task up by id; raises KeyError with a hint."""
    for t in all_tasks():
        if t.task_id == task_id:
            return t
    raise KeyError(f"no task {task_id!r} in the task family")


def tokenizer_corpus() -> list[str]:
    """Texts the presets' tokenizer is trained on: prompts plus every solution form, of the training
    tasks only (no held-out text shapes the vocabulary)."""
    out = []
    for t in train_tasks():
        out.append(t.prompt + t.concise)
        out.append(t.verbose)
        out.extend(t.wrong[:1])
    return out
