"""Resource report: registers, scratch, spill, LDS/shared memory and occupancy per variant
(occupancy: ``epgen.codegen.occupancy``)."""

from __future__ import annotations

import csv
import io

from epgen.codegen.occupancy import occupancy
from epgen.codegen.offline import CompileError
from epgen.codegen.spec import KernelSpec

COLUMNS = ("arch", "op", "entry", "registers", "agprs", "sgprs", "scratch_bytes", "spill_bytes", "shared_bytes",
           "occupancy", "occupancy_unit", "status")


def rows(specs: list[KernelSpec], results: list) -> list[dict]:
    """One row per (spec, compile result); status is 'ok', 'scratch/spill' or 'compile error: ...';
    a number the target does not have (AGPRs, SGPRs on sm_90) or a failed compile gives None."""
    out = []
    for spec, res in zip(specs, results):
        row = {"arch": spec.arch, "op": spec.op.value, "entry": spec.name}
        if isinstance(res, CompileError):
            out.append({**row, **{c: None for c in COLUMNS[3:-1]}, "status": f"compile error: {res}"})
            continue
        occ, unit = occupancy(spec, res)
        out.append({**row, "registers": res.registers, "agprs": res.agprs, "sgprs": res.sgprs,
                    "scratch_bytes": res.scratch_bytes,
                    "spill_bytes": res.spill_bytes, "shared_bytes": res.shared_bytes, "occupancy": occ,
                    "occupancy_unit": unit, "status": "ok" if res.ok else "scratch/spill"})
    return out


def to_markdown(report_rows: list[dict], title: str) -> str:
    """A Markdown table (stable text: committed beside the catalogue)."""
    head = ("arch", "op", "entry", "VGPRs/regs", "AGPRs", "SGPRs", "scratch B", "spill B", "LDS/shared B",
            "occupancy", "status")
    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report_rows:
        occ = f"{r['occupancy']} {r['occupancy_unit']}" if r["occupancy"] is not None else ""
        lines.append("| " + " | ".join("" if x is None else str(x) for x in (r["arch"], r["op"], f"`{r['entry']}`", r["registers"],
                                                        r["agprs"], r["sgprs"], r["scratch_bytes"], r["spill_bytes"],
                                                        r["shared_bytes"], occ, r["status"])) + " |")
    return "\n".join(lines) + "\n"


def to_csv(report_rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(report_rows)
    return buf.getvalue()
