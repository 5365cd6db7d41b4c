"""Where the quantized combine's time goes, on one GPU with virtual ranks
(docs/measurements/quantized-combine.md#bandwidth).

For each combine wire at deepseek-v3, W = 2 virtual ranks, uniform routing, T tokens a rank: the
whole combine (quantize kernel + combine kernel, as ``op.combine`` runs them), each kernel alone,
and ablations of the quantize kernel built from its rendered source (the same access pattern with
the encoder cut down): ``copy`` stores bits of the loaded vector instead of codes (pure memory
traffic), ``no_div`` multiplies by the scale instead of dividing (timing only: not the wire's
rounding), and of the combine kernel: ``own_as_bf16`` adds a rank's own rows as bf16 (what adding
them as their wire rows decode costs), ``own_codes`` encodes them to codes and decodes those
(as the combine did before it rounded them) instead of rounding them to the format's grid. Then geometry sweeps of both
kernels (the combine's where every block of both ranks fits at once). The CSV's ``exact`` column
says whether a variant wrote the same bytes as the stock kernel. Every figure is the mean of K
launches captured in one CUDA graph, replayed 5 times (DESIGN.md section 4: no host launch in the
figure), with the bytes each kernel moves and the rate they imply.

    python tools/quant_profile.py [--tokens 4096 8192] [--sweep] [-o tools/results/quant-profile-h200]
"""

from __future__ import annotations

import argparse
import csv
import itertools

import torch

from epgen.codegen.config import EpConfig
from epgen.codegen.render import render
from epgen.codegen.spec import Op
from epgen.op import EpDispatchCombine
from epgen.harness.verify import make_inputs, op_inputs, run_round

K = 20
WIRES = ("none", "fp8_blockwise", "fp4_blockwise", "fp8_direct_cast")
QUANTIZE_CALL = "ep_wire_quantize(v[u], i, i < kRowVectors, wire + (ep_u64)r * kSrcRowBytes);"
OWN_ROW_ADD = "ep_wire_add_roundtrip(acc[u], b[u], c + u * kWave + lane < kRowVectors);"
COMBINE_ABLATIONS = {
    # a rank's own rows added as their bf16 values: what adding them as their wire rows decode costs
    "own_as_bf16": [(OWN_ROW_ADD, "for (int k = 0; k < 8; ++k) acc[u][k] += ep_bf16_element(b[u], k);")],
    # the own rows encoded to codes and decoded (as the combine did before) instead of rounded to the grid
    "own_codes": [(OWN_ROW_ADD, "{ const bool valid = c + u * kWave + lane < kRowVectors; float s; "
                                "const ep_wire w = ep_wire_encode(b[u], valid, s); ep_wire_add(acc[u], w, valid ? s : 0.0f); }")],
}
ABLATIONS = {
    "copy": [(QUANTIZE_CALL, "if (i < kRowVectors) ep_wire_store(wire + (ep_u64)r * kSrcRowBytes, i, "
                             "(ep_wire)(ep_vec_word(v[u], 0) ^ ep_vec_word(v[u], 1) ^ ep_vec_word(v[u], 2)));")],
    "no_div": [("{ return ep_div_rn(ep_bf16_element(v, k), s); }", "{ return ep_bf16_element(v, k) * s; }")],
}


def graph_us(launch) -> float:
    """Mean microseconds of one ``launch()`` over K launches in one graph, best of 5 replays."""
    launch()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(K):
            launch()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / K)
    return best


class Setup:
    """One virtual W = 2 op after a dispatch, its y (combine_input) filled, ready to time."""

    def __init__(self, mode: str, tokens: int):
        self.cfg = EpConfig.for_model("deepseek-v3", world_size=2, max_tokens_per_rank=tokens, combine_quant=mode,
                                      kernel_family="normal")
        self.op = EpDispatchCombine(self.cfg, virtual=True)
        run_round(self.op, self.cfg, [tokens] * 2, "uniform", 3)  # checked once before it is timed
        inputs = make_inputs(self.cfg, [tokens] * 2, "uniform", 4, device=self.op.device)
        outs = self.op.dispatch(*op_inputs(self.op, inputs))
        self.ys = [self.op.combine_input(r) for r in self.op.local_ranks]
        for y in self.ys:
            y.normal_()
        self.outs = [torch.empty(tokens, self.cfg.hidden, dtype=torch.bfloat16, device=self.op.device) for _ in range(2)]
        self.op.combine(self.ys, out=self.outs)  # fills the kernels' io records
        self.op.synchronize()
        rows = [int(o.num_recv) for o in outs]
        other = [int((o.recv_src[:n, 0] != r).sum()) for r, (o, n) in enumerate(zip(outs, rows))]
        H, q = self.cfg.hidden, self.op.dispatch_spec.quant
        wire = q.wire_row_bytes(H) if q.quantized else 2 * H
        self.quantize_bytes = sum(other) * (2 * H + wire)
        own = [n - o for n, o in zip(rows, other)]
        # combine: own rows as bf16 (quantized) or every row as bf16, the other ranks' wire rows, out
        self.combine_bytes = (sum(own) * 2 * H + sum(other) * wire + 2 * tokens * 2 * H) if q.quantized else \
            (sum(rows) * 2 * H + 2 * tokens * 2 * H)

    def launch(self, op_kind: Op, fn=None, spec=None):
        """A launch of ``op_kind``'s kernel alone (``EpDispatchCombine.launch_kernel``): the op's, or
        ``fn`` loaded from ``spec``."""
        kernel = None if fn is None else (spec, fn)
        return lambda: self.op.launch_kernel(op_kind, self.cfg.max_tokens_per_rank, kernel)

    def result(self, op_kind: Op) -> bytes:
        """What the last launches of ``op_kind``'s kernel wrote: the wire rows (the quantize
        kernel) or the outputs (the combine kernel), as bytes, to compare a variant with the stock
        kernel (False in the CSV's exact column: it computed something else)."""
        self.op.synchronize()
        if op_kind is Op.COMBINE:
            return b"".join(o.cpu().view(torch.uint8).numpy().tobytes() for o in self.outs)
        wires = [self.op.combine_wire_input(r) for r in self.op.local_ranks]
        return b"".join(t.cpu().numpy().tobytes() for w in wires for t in (w.codes, w.scales) if t is not None)

    def variant(self, spec, edits=()):
        """``spec``'s kernel loaded with ``edits`` applied to its source; None when one does not apply
        (the wire has no such step, e.g. no division in fp8_direct_cast)."""
        text = render(spec).text
        for old, new in edits:
            if old not in text:
                return None
            text = text.replace(old, new)
        return self.op.platform.load_kernel(text, spec.name, self.op.device.index)


def profile(mode: str, tokens: int, sweep: bool) -> list[dict]:
    s = Setup(mode, tokens)
    rows = []

    def row(what, kernel, us, nbytes, geometry="", exact=""):
        rows.append({"wire": mode, "tokens": tokens, "what": what, "kernel": kernel, "geometry": geometry,
                     "us": round(us, 2), "bytes": nbytes, "tb_s": round(nbytes / us / 1e6, 2) if nbytes else "",
                     "exact": exact})

    quantized = (Op.COMBINE_QUANTIZE, "push") in s.op.plan.variants
    # the call's kernels as op.combine launches them (each call needs a dispatch before it)
    kernels = [s.launch(Op.COMBINE_QUANTIZE)] if quantized else []
    kernels.append(s.launch(Op.COMBINE))
    row("combine (whole call)", "op.combine", graph_us(lambda: [k() for k in kernels]),
        s.quantize_bytes + s.combine_bytes)

    def kernel(op_kind, label, nbytes, ablations, grid):
        """``op_kind``'s kernel alone, its ablations, then (with ``sweep``) the geometries of ``grid``."""
        spec = s.op.variant(op_kind, tokens)
        g = f"{spec.blocks}x{spec.warps_per_block}u{spec.unroll}"
        row(f"{label} kernel", op_kind.value, graph_us(s.launch(op_kind)), nbytes, g)
        stock = s.result(op_kind)
        for name, edits in ablations.items():
            fn = s.variant(spec, edits)
            if fn is not None:
                row(f"{label}, {name}", op_kind.value, graph_us(s.launch(op_kind, fn, spec)), nbytes, g,
                    s.result(op_kind) == stock)
        for blocks, warps, unroll in (itertools.product(*grid) if sweep else ()):
            other = spec.replace(blocks=blocks, warps_per_block=warps, unroll=unroll)
            fn = s.variant(other)
            if op_kind is Op.COMBINE and 2 * blocks > s.op.resident_blocks(fn, other):
                continue  # virtual ranks: every block of both ranks' combine must be resident at once
            us = graph_us(s.launch(op_kind, fn, other))
            row("sweep", op_kind.value, us, nbytes, f"{blocks}x{warps}u{unroll}", s.result(op_kind) == stock)

    if quantized:
        kernel(Op.COMBINE_QUANTIZE, "quantize", s.quantize_bytes, ABLATIONS, ((264, 528), (8, 16, 32), (2, 4, 8)))
    kernel(Op.COMBINE, "combine", s.combine_bytes, COMBINE_ABLATIONS,
           ((32, 64, 66, 132), (8, 16) if quantized else (16, 32), (2, 4)))
    s.op.close()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--wires", nargs="+", default=list(WIRES))
    p.add_argument("--sweep", action="store_true", help="geometry sweeps of both kernels (first --tokens only)")
    p.add_argument("-o", "--output", default="tools/results/quant-profile-h200")
    args = p.parse_args()
    rows = []
    for i, tokens in enumerate(args.tokens):
        for mode in args.wires:
            rows += profile(mode, tokens, args.sweep and i == 0)
    with open(args.output + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        if r["what"] != "sweep":
            print(f"{r['wire']:>15} T={r['tokens']:>5} {r['what']:<22} {r['geometry']:>10} {r['us']:>9.2f} us "
                  f"{r['bytes'] / 1e6:>8.1f} MB {r['tb_s']!s:>6} TB/s {'exact' if r['exact'] is True else r['exact']}")
    for kernel in ("combine_quantize", "combine"):
        best = {}
        for r in rows:
            if r["what"] == "sweep" and r["kernel"] == kernel:
                key = (r["wire"], r["tokens"])
                if key not in best or r["us"] < best[key]["us"]:
                    best[key] = r
        for (mode, tokens), r in best.items():
            print(f"best {kernel} geometry {mode} T={tokens}: {r['geometry']} {r['us']} us ({r['tb_s']} TB/s, "
                  f"exact {r['exact']})")


if __name__ == "__main__":
    main()
