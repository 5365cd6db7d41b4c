"""Resource report: registers, scratch, spill, LDS/shared memory and occupancy per variant
(occupancy: ``epgen.codegen.occupancy``)."""

from __future__ import annotations

import csv
import io

from rich import box
from rich.markup import escape

from epgen.codegen.dtypes import combine_quant
from epgen.codegen.occupancy import occupancy
from epgen.codegen.offline import CompileError
from epgen.codegen.spec import KernelSpec, Op

COLUMNS = ("arch", "op", "entry", "registers", "agprs", "sgprs", "scratch_bytes", "spill_bytes", "shared_bytes",
           "occupancy", "occupancy_unit", "status")


def rows(specs: list[KernelSpec], results: list, compilers: dict[str, str] | None = None) -> list[dict]:
    """One row per (spec, compile result): ``COLUMNS``, plus ``spec`` (its fields,
    ``KernelSpec.as_dict``) and, with ``compilers`` ({arch: exact offline compiler release}),
    ``compiler``; status is 'ok', 'scratch/spill' or 'compile error: ...'; a number the target
    does not have (AGPRs, SGPRs on sm_90) or a failed compile gives None."""
    out = []
    for spec, res in zip(specs, results):
        row = {"arch": spec.arch, "op": spec.op.value, "entry": spec.name, "spec": spec.as_dict()}
        if compilers is not None:
            row["compiler"] = compilers[spec.arch]
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
    """Markdown (stable text: committed beside the catalogue): the title, a summary of one row per
    kernel kind (``summary``), then a table of every kernel."""
    head = ("arch", "op", "entry", "VGPRs/regs", "AGPRs", "SGPRs", "scratch B", "spill B", "LDS/shared B",
            "occupancy", "status")
    lines = [f"# {title}", "", *summary(report_rows), "", "## Every kernel", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report_rows:
        occ = f"{r['occupancy']} {r['occupancy_unit']}" if r["occupancy"] is not None else ""
        lines.append("| " + " | ".join("" if x is None else str(x) for x in (r["arch"], r["op"], f"`{r['entry']}`", r["registers"],
                                                        r["agprs"], r["sgprs"], r["scratch_bytes"], r["spill_bytes"],
                                                        r["shared_bytes"], occ, r["status"])) + " |")
    return "\n".join(lines) + "\n"


def summary(report_rows: list[dict]) -> list[str]:
    """Markdown lines: how many kernels are not ok, then a table of one row per kernel kind (in
    ``Op`` order) and one column per arch (in the rows' order) whose cell reads ``N: R regs, S B,
    occ O``: the kind's kernels on the arch, their VGPRs/registers (min-max), their most LDS/shared
    bytes and their lowest occupancy, then how many are not ok."""
    arches = list(dict.fromkeys(r["arch"] for r in report_rows))
    kinds = [op.value for op in Op if any(r["op"] == op.value for r in report_rows)]
    bad = [r for r in report_rows if r["status"] != "ok"]
    lines = [f"{len(report_rows)} kernels, " + (f"{len(bad)} not ok (compile error, scratch or spill: status below)"
                                              if bad else "every one ok (no compile error, scratch or spill)") + ". "
             "Per kind and arch: kernels, VGPRs/registers, most LDS/shared bytes, lowest occupancy (waves per SIMD "
             "on AMD, blocks per SM on NVIDIA).", "",
             "| kind | " + " | ".join(arches) + " |", "|" + "---|" * (len(arches) + 1)]
    for kind in kinds:
        cells = []
        for arch in arches:
            rows = [r for r in report_rows if r["op"] == kind and r["arch"] == arch]
            ok = [r for r in rows if r["registers"] is not None]
            cell = f"{len(rows)}" if rows else ""
            if ok:
                regs = sorted(r["registers"] for r in ok)
                span = f"{regs[0]}" if regs[0] == regs[-1] else f"{regs[0]}-{regs[-1]}"
                occ = [r["occupancy"] for r in ok if r["occupancy"] is not None]
                cell += f": {span} regs, {max(r['shared_bytes'] for r in ok)} B" + (f", occ {min(occ)}" if occ else "")
            failed = sum(r["status"] != "ok" for r in rows)
            cells.append(cell + (f", {failed} not ok" if failed else ""))
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    return lines


def to_csv(report_rows: list[dict]) -> str:
    """CSV of ``COLUMNS`` (the full entry name included; ``spec`` and ``compiler`` left out)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    w.writerows(report_rows)
    return buf.getvalue()


_SHAPE_PARTS = (("world_size", "w"), ("hidden", "h"), ("topk", "k"), ("experts_per_rank", "l"),
                ("max_tokens_per_rank", "t"), ("scale_bytes", "s"))
_OPTIONAL_PARTS = (("recv_tokens", "r"), ("expert_alignment", "a"))
"""Fields a label names only when set (receive cap, expert layout), as the entry name does."""


def variant_labels(specs: list[dict]) -> tuple[list[str], str]:
    """Short labels of ``specs`` (``KernelSpec.as_dict`` dicts) for a table, and what they leave
    out: per spec its payload (the dispatch kernels, expand_plan, expand: the dtype; the combine
    kernels of both families and fold: the wire, bf16 or a quant tag such as qfp8b), the shape fields that differ between the specs (w, h, k, l, t, s as in the entry
    name) and the launch geometry BLOCKSxWARPSuUNROLL. The shape fields every spec shares form the
    second value, e.g. ``"w8 h7168 k8 l32 t4096"``; a receive cap and the expert layout's
    alignment (``_OPTIONAL_PARTS``) are named where set. The transport is not in the label:
    ``op_label`` names the pull dispatch's first kernel."""
    def payload(s: dict) -> str:
        return s["dtype"] if Op(s["op"]).payload else combine_quant(s["combine_quant"]).tag or "bf16"

    shared = [(f, tag) for f, tag in _SHAPE_PARTS if len({s[f] for s in specs}) == 1]
    varying = [(f, tag) for f, tag in _SHAPE_PARTS if (f, tag) not in shared]
    labels = [" ".join([payload(s), *(f"{tag}{s[f]}" for f, tag in varying),
                        *(f"{tag}{s[f]}" for f, tag in _OPTIONAL_PARTS if s.get(f)),
                        f"{s['blocks']}x{s['warps_per_block']}u{s['unroll']}"]) for s in specs]
    common = " ".join(f"{tag}{specs[0][f]}" for f, tag in shared if not (f == "scale_bytes" and not specs[0][f]))
    return labels, common


CAPTION_WIDTH = 80
"""Narrowest console table: its caption wraps at the table's width, so a table of few columns
would fold its caption into a narrow column."""


def styled_table(title: str, caption: str):
    """An empty rich table in the style of epgen's console tables: a rule under the header, no
    frame, one space between columns, the caption left-aligned under it."""
    from rich.table import Table

    return Table(title=title, caption=caption, box=box.SIMPLE_HEAD, show_edge=False, padding=0, pad_edge=False,
                 caption_justify="left", min_width=CAPTION_WIDTH)


# (header, row key, caption name): columns that leave the table for the caption when every row has the same value
_FOLDABLE = (("AGPR", "agprs", "AGPRs"), ("SGPR", "sgprs", "SGPRs"))


_NUMBERS = ("regs", "AGPR", "SGPR", "LDS", "occ")


def op_label(row: dict) -> str:
    """The op of a report row, "dispatch (pull)" for the pull dispatch's first kernel (its spec's
    ``transport``): as long as the longest op name, so the table keeps its width."""
    return row["op"] + (" (pull)" if row["spec"].get("transport") == "pull" else "")


def resource_table(report_rows: list[dict], title: str):
    """A rich table of ``rows`` that reads at 80 columns, one line a row: a short variant label
    (``variant_labels``) instead of the entry name (which ``--json`` and the CSV carry); the shape
    every row shares, the AGPR and SGPR values every row shares (with more than one row; a value no
    target of the rows has, such as SGPRs on sm_90, is left out) and the compilers in the caption
    instead of in columns. Scratch, spill and status never take columns (they would push the rows
    past 80 columns): the caption gives them for every ok row (scratch 0, spill 0) and names each
    other row, which is red, with its scratch, spill and status."""
    labels, common = variant_labels([r["spec"] for r in report_rows])
    compilers = {r["arch"]: r["compiler"] for r in report_rows if r.get("compiler")}
    shared = [(head, key, name) for head, key, name in _FOLDABLE
              if len(report_rows) > 1 and len({r[key] for r in report_rows}) == 1]
    every = [common] if common else []
    every += [f"{name} {report_rows[0][key]}" for _, key, name in shared if report_rows[0][key] is not None]
    failed = [(r, label) for r, label in zip(report_rows, labels) if r["status"] != "ok"]
    ok = "scratch 0, spill 0, status ok" + (", except these (red in the table):" if failed else "")
    caption = [f"every row: {', '.join(every)}; {ok}" if every else ok]
    caption += [escape(f"  {r['arch']} {op_label(r)} {label}: scratch {r['scratch_bytes']}, spill {r['spill_bytes']}, "
                       f"status {r['status']}") for r, label in failed]
    caption += ["scratch, spill, LDS (AMD) or shared memory (NVIDIA) in bytes; occupancy in waves per SIMD (AMD) "
                "or blocks per SM (NVIDIA)"]
    caption += [f"{arch}: {c}" for arch, c in compilers.items()]
    t = styled_table(title, "\n".join(caption))
    columns = [("arch", "arch"), ("op", "op"), ("variant", None), ("regs", "registers"), ("AGPR", "agprs"),
               ("SGPR", "sgprs"), ("LDS", "shared_bytes"), ("occ", "occupancy")]
    columns = [(head, key) for head, key in columns if head not in {h for h, _, _ in shared}]
    for c, _ in columns:
        # a long op name (dispatch_ll_send) or label folds only where the console is narrower than 80 columns
        t.add_column(c, overflow="fold", no_wrap=c not in ("variant", "op"), justify="right" if c in _NUMBERS else "left")
    for r, label in zip(report_rows, labels):
        t.add_row(*(label if c == "variant" else op_label(r) if c == "op" else "" if r[key] is None else str(r[key])
                    for c, key in columns),
                  style="red" if r["status"] != "ok" else None)
    return t
