"""The task family and the sandboxed checker, including hostile candidates."""

from __future__ import annotations

import time

from policy.checker import Limits, check, check_many
from policy.tasks import all_tasks, heldout_eval_set, heldout_tasks, task_by_id, train_tasks


def test_family_is_large_tiered_and_split() -> None:
    tasks = all_tasks()
    assert len(tasks) >= 2000
    assert {t.tier for t in tasks} == {1, 2, 3}
    assert len({t.task_id for t in tasks}) == len(tasks)
    held = {t.task_id for t in heldout_tasks()}
    assert held and held.isdisjoint({t.task_id for t in train_tasks()})
    evalset = heldout_eval_set(8)
    assert len(evalset) == 24 and all(t.task_id in held for t in evalset)
    assert task_by_id(evalset[0].task_id) == evalset[0]


def test_held_out_tasks_come_from_templates_never_trained_on_in_every_tier() -> None:
    held, train = heldout_tasks(), train_tasks()
    held_templates = {t.template for t in held}
    assert held_templates.isdisjoint({t.template for t in train})
    assert {t.tier for t in held} == {1, 2, 3}
    assert 0.08 < len(held) / len(all_tasks()) < 0.2
    # a held-out template is a new combination of parts that training does show
    assert "t2/list/plus/divisible" in held_templates
    assert any(t.template.startswith("t2/list/") for t in train)
    assert any(t.template.endswith("/divisible") for t in train)


def test_the_tokenizer_is_fitted_without_held_out_text() -> None:
    from policy.tasks import tokenizer_corpus

    corpus = "\n".join(tokenizer_corpus())
    assert all(t.prompt not in corpus for t in heldout_tasks())  # no held-out spec shaped the vocabulary
    assert all(t.prompt in corpus for t in train_tasks()[::50])


def test_reference_solutions_behave_as_labelled() -> None:
    sample = list(all_tasks())[::23]
    items = []
    for t in sample:
        items += [(t, t.concise), (t, t.verbose)] + [(t, w) for w in t.wrong]
    results = iter(check_many(items))
    for t in sample:
        concise, verbose = next(results), next(results)
        assert concise.kept, t.spec
        assert verbose.passed and not verbose.kept, t.spec
        for _ in t.wrong:
            assert not next(results).passed, t.spec


def test_edge_case_tier_tests_the_empty_list() -> None:
    tier3 = [t for t in all_tasks() if t.tier == 3]
    assert all(any(args == ([],) for args, _ in t.tests) for t in tier3)


def test_hostile_candidates_fail_alone() -> None:
    task = train_tasks()[0]
    hostile = [
        "    while True:\n        pass\n",
        "    import os\n    os._exit(0)\n",
        "    import socket\n    socket.create_connection(('127.0.0.1', 5432))\n    return 0\n",
        "    x = bytearray(4 * 1024 ** 3)\n    return x\n",
        "    import signal\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n        pass\n",
        "    print('x' * 10_000_000)\n",
        "    return (\n",  # syntax error
        "    raise SystemExit(0)\n",
        "    open('big.txt', 'w').write('x' * 10_000_000)\n",
        "x" * 10_000,  # oversized
        "",
    ]
    start = time.monotonic()
    results = check_many([(task, h) for h in hostile] + [(task, task.concise)], Limits(per_candidate_s=0.5, wall_s=4))
    assert time.monotonic() - start < 30
    assert [r.passed for r in results] == [False] * len(hostile) + [True]


def test_wrong_function_name_and_duplicates() -> None:
    task = train_tasks()[0]
    renamed = f"{task.concise}\ng = f\ndel f\n"
    assert not check(task, renamed).passed
    twice = check_many([(task, task.concise)] * 3)
    assert all(r.kept for r in twice)
