"""Replay one random sequence of observations and offers into the controller as it was before the
redesign and into the new control package; every plan must be equal. Run from the repository:

    mkdir -p /tmp/equiv
    git show "$(git log -1 --format=%H --diff-filter=D -- vllm_selfspec/controller.py)^:vllm_selfspec/controller.py" \
        > /tmp/equiv/old_controller.py
    .venv/bin/python benchmarks/results/redesign-check-2026-11-23/controller_replay.py SEED
"""
import random, sys
sys.path.insert(0, "/tmp/equiv")
import old_controller as old
from vllm_selfspec.control import DraftController, RowOffer

rng = random.Random(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
a, b = old.DraftController(), DraftController()
mismatches = plans = drafting = explored = 0
for step in range(3000):
    rows = rng.randint(1, 12)
    prompt = rng.choice([0, 0, 0, 500])
    drafts = rng.choice([0, 0, rng.randint(1, 10)])
    sampled = rng.randint(0, rows)
    secs = 0.05 + 0.01 * rows + 0.0005 * prompt + 0.004 * drafts + rng.random() * 0.01
    a.observe_step(prompt, rows + drafts, sampled, secs, drafts)
    b.observe_step(prompt, rows + drafts, sampled, secs, drafts)
    if rng.random() < 0.3:
        m, s = rng.randint(1, 4), 0.02 + rng.random() * 0.1
        a.observe_self_step(m, s); b.observe_self_step(m, s)
    if rng.random() < 0.05:
        n, s = rng.randint(1, 3), rng.random()
        a.observe_probe(n, s); b.observe_probe(n, s)
    offers_a, offers_b = [], []
    for i in range(rows):
        n = rng.choice([0, 0, 1, 2, 3, 4])
        probs = tuple(sorted((rng.random() for _ in range(n)), reverse=True)) if rng.random() < 0.8 else ()
        kw = dict(req_id=f"r{rng.randint(0, 20)}", lookup_source=rng.choice(["lookup", "history"]),
                  can_self_draft=rng.random() < 0.7, sampled=rng.random() < 0.3, lookup_probs=probs,
                  lookup_match=rng.randint(0, 12), remaining=rng.choice([None, rng.randint(1, 60)]),
                  has_mask=rng.random() < 0.5)
        offers_a.append(old.RowOffer(lookup=n, **kw)); offers_b.append(RowOffer(lookup_tokens=n, **kw))
    budget, draining = rng.choice([0, 4]), rng.random() < 0.3
    pa, pb = a.plan(offers_a, budget, draining), b.plan(offers_b, budget, draining)
    plans += 1
    drafting += bool(sum(pa.lookup_lengths) or pa.self_length)
    explored += pa.explored
    if (pa.lookup_lengths, pa.self_length, pa.explored, pa.self_rows) != (pb.lookup_lengths, pb.self_length, pb.explored, pb.self_rows):
        mismatches += 1
    for o_a, o_b, length in zip(offers_a, offers_b, pa.lookup_lengths):
        if length:
            acc = rng.randint(0, length)
            ca, cb = a.calibration(o_a, length), b.calibration(o_b, length)
            a.observe_draft(o_a.req_id, o_a.lookup_source, length, acc, ca)
            b.observe_draft(o_b.req_id, o_b.lookup_source, length, acc, cb)
    if pa.self_length:
        acc = rng.randint(0, pa.self_length)
        a.observe_draft("s", "self", pa.self_length, acc); b.observe_draft("s", "self", pa.self_length, acc)
    if rng.random() < 0.05:
        r = f"r{rng.randint(0, 20)}"; a.forget(r); b.forget(r)
print(f"seed {sys.argv[1:]}: {plans} plans ({drafting} with drafts, {explored} retries), {mismatches} differ")
