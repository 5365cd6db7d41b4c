"""Every MoE family of the installed transformers, made expert-parallel on the CPU (backend
"reference"): those whose experts follow its experts conventions (``@use_experts_implementation``)
and those outside them (``hf_models.outside_families``: epgen reads dbrx and llama4 otherwise,
``epgen.integrations.transformers.READERS``, and refuses the rest naming the module, its class and
why).

For each family: a tiny seeded model from its config class (``hf_models.family_model``: H = 64, two
layers, 8 experts, top-2 where the config takes it), epgen's refusal if any, ``EpConfig.from_hf_config``
on its config, logits at virtual W = 1, 2 and 4 within 2 x the model's own bf16 error
(``hf_models.bf16_envelope``), and greedy generation at W = 2 against the model's bf16 eager path
(``hf_models.check_generation``: a routing near-tie is re-run on the EP routing, and counted). A
family that cannot be built, or that epgen refuses, is a row with the reason.

FAST runs by default; the full sweep is marked ``models`` (run with -m models). With
EPGEN_WRITE_FAMILY_TABLE=1 the sweep rewrites the table in docs/transformers.md (between the
markers); without it, the sweep checks that the committed table matches what it measured.
"""

import copy
import os
import pathlib
import re

import pytest

pytest.importorskip("transformers", reason="the optional transformers dependency (pip install -e '.[dev]') is missing")

import torch  # noqa: E402

import hf_models  # noqa: E402
from epgen.codegen.config import EpConfig  # noqa: E402
from epgen.integrations.transformers import READERS, expert_parallel, reader  # noqa: E402
from epgen.reference import relative_l2  # noqa: E402

FAMILIES = sorted(hf_models.experts_families() + hf_models.outside_families())
FAST = [f for f in ("ernie4_5_moe", "hunyuan_v1_moe", "dbrx", "llama4") if f in FAMILIES]
WORLDS = (1, 2, 4)
PROMPT = hf_models.prompt(1, batch=4, length=64)
DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "transformers.md"
BEGIN, END = "<!-- family table: begin (tests/runtime/integrations/test_transformers_families.py) -->", "<!-- family table: end -->"


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


def run_family(family: str) -> dict:
    """The family's row: {"family", "accepted", "ratios": {W: error / envelope}, "generation", "ties"}
    or with "reason" where it could not be built or was refused; a generation that fails its check
    reads "FAILED: ..." (``failures``)."""
    row = {"family": family, "accepted": False, "ratios": {}, "generation": "", "ties": 0, "reason": ""}
    try:
        model32 = hf_models.family_model(family)
    except Exception as e:  # noqa: BLE001 - a family the tiny config does not build: a row with the reason
        row["reason"] = f"not built: {_first_line(e)}"
        return row
    try:  # epgen's refusal first (a family outside the conventions: the module, its class and why)
        expert_parallel(copy.deepcopy(model32).to(torch.bfloat16), world_size=1, backend="reference")
    except ValueError as e:
        row["reason"] = f"refused: {_first_line(e)}"
        return row
    try:
        envelope, ref = hf_models.bf16_envelope(model32, PROMPT)  # the model's own paths, before epgen's
    except Exception as e:  # noqa: BLE001 - a family whose own tiny model does not run
        row["reason"] = f"not built: {_first_line(e)}"
        return row
    first = next(m for m in model32.modules() if any(r.matches(m) for r in READERS))
    cfg = EpConfig.from_hf_config(reader(first).config(first, model32), world_size=1, max_tokens_per_rank=8)
    assert (cfg.num_experts, cfg.hidden) == reader(first).shape(first)[:2], (family, cfg)
    row["accepted"] = True
    try:  # accepted: anything raised from here on is a failure of the row (``failures``)
        for world in WORLDS:
            model = copy.deepcopy(model32).to(torch.bfloat16)
            expert_parallel(model, virtual=True, world_size=world, backend="reference", max_tokens_per_rank=1024)
            row["ratios"][world] = relative_l2(hf_models.logits(model, PROMPT), ref) / envelope
        model = copy.deepcopy(model32).to(torch.bfloat16)
        expert_parallel(model, virtual=True, world_size=2, backend="reference", max_tokens_per_rank=1024)
        verdict = hf_models.check_generation(model, hf_models.eager_bf16(model32), PROMPT[:1, :8], envelope)
    except Exception as e:  # noqa: BLE001 - the row says what failed; the sweep fails after the table
        row["generation"] = f"FAILED: {_first_line(e)}"
        return row
    m = re.match(r"(\d+) routing near-tie", verdict)
    row["ties"] = int(m.group(1)) if m else 0
    row["generation"] = ("identical" if verdict == "identical" else f"{row['ties']} routing tie(s)" if m
                         else "near-tie flip")
    return row


def table(rows: list[dict]) -> str:
    head = ["family", "accepted"] + [f"W={w} ratio" for w in WORLDS] + ["generation (W=2)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ratios = [f"{r['ratios'][w]:.2f}" if w in r["ratios"] else "" for w in WORLDS]
        lines.append("| " + " | ".join([r["family"], "yes" if r["accepted"] else "no"] + ratios
                                       + [r["generation"] or r["reason"].replace("|", "/")]) + " |")
    run = [r for r in rows if r["accepted"]]
    lines.append("")
    lines.append(f"{len(rows)} MoE families; {len(run)} accepted and run, "
                 f"{sum(all(v <= 2 for v in r['ratios'].values()) for r in run)} within 2 x their own bf16 error "
                 f"at every W; {sum(r['ties'] for r in run)} routing near-tie token(s) in generation.")
    return "\n".join(lines)


def failures(rows: list[dict]) -> list[str]:
    """The accepted families above the bound at some W, or whose generation failed its check."""
    return [f"{r['family']}: ratios {r['ratios']}, generation {r['generation']}" for r in rows if r["accepted"] and (
        any(v > 2 for v in r["ratios"].values()) or r["generation"].startswith("FAILED"))]


@pytest.mark.parametrize("family", FAST)
def test_fast_families(family):
    row = run_family(family)
    print(row)
    assert row["accepted"], row["reason"]
    assert not failures([row])


@pytest.mark.models
def test_every_family_and_the_docs_table():
    rows = []
    for family in FAMILIES:
        rows.append(run_family(family))
        print(rows[-1], flush=True)
    text = table(rows)
    print(text)
    doc = DOC.read_text()
    assert BEGIN in doc and END in doc, f"{DOC}: the family table's markers are missing"
    before, rest = doc.split(BEGIN, 1)
    _, after = rest.split(END, 1)
    if os.environ.get("EPGEN_WRITE_FAMILY_TABLE") == "1":
        DOC.write_text(f"{before}{BEGIN}\n{text}\n{END}{after}")
    assert not failures(rows), failures(rows)
    if os.environ.get("EPGEN_WRITE_FAMILY_TABLE") == "1":
        return
    committed, now = dict(_shape(rest.split(END, 1)[0].strip())), dict(_shape(text))
    both = committed.keys() & now.keys()  # another transformers release ships other families
    differ = {f: (committed[f], now[f]) for f in both if committed[f] != now[f]}
    assert not differ, (f"docs/transformers.md's family table differs from this run (family: committed, now): {differ}; "
                        "rerun with EPGEN_WRITE_FAMILY_TABLE=1")


def _shape(text: str) -> list:
    """Each row's family and whether it was accepted (the first two cells): the ratios and the
    generation verdicts come from float reductions and router near-ties that differ across CPUs,
    and are checked against the bound by the run itself."""
    return [tuple(c.strip() for c in line.split("|")[1:3]) for line in text.splitlines() if line.startswith("|")]
