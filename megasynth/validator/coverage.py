"""Coverage of catalogue ops: every logical output of every layer is produced exactly once (no gap, no duplicate),
and a QK-norm model's q heads are normalised exactly once."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

from megasynth.ir.catalogue import FUSED_OPROJ, MERGE_OPS, OPS, required_tiles, sequences
from megasynth.ir.program import Finding, Program


def _key_name(key: tuple) -> str:
    """A coverage key as words: 'attn_partial layer 3 kv_head 1'."""
    if key[0] == "attn_reduce" and len(key) > 2:  # a batch: (op, layer, seq)
        return f"attn_reduce layer {key[1]} seq {key[2]}"
    return f"{key[0]}" + (f" layer {key[1]}" if len(key) > 1 and key[1] >= 0 else "") + \
        (f" kv_head {key[2]}" if len(key) > 2 else "") + (f" seq {key[3]}" if len(key) > 3 else "")


def _partition_findings(key: tuple, domain: tuple, tiles: list[tuple[tuple, int]], prog: Program) -> list[Finding]:
    """Check that `tiles` (rect, instruction index) partition the rectangle `domain` exactly."""
    (r0, r1), (k0, k1) = domain
    name = _key_name(key)
    cuts = sorted({r0, r1} | {t[0][0][0] for t in tiles} | {t[0][0][1] for t in tiles})
    out: list[Finding] = []
    by_start = sorted(tiles, key=lambda t: t[0][0][0])
    active: list[tuple[tuple, int]] = []  # the tiles whose rows contain the current interval (a sweep: linear)
    nxt = 0
    for lo, hi in pairwise(cuts):
        while nxt < len(by_start) and by_start[nxt][0][0][0] <= lo:
            active.append(by_start[nxt])
            nxt += 1
        active = [t for t in active if t[0][0][1] > lo]  # every row bound is a cut: then hi <= its end too
        if lo >= r1 or hi <= r0:
            continue
        cols = sorted((t[0][1], t[1]) for t in active)
        at = k0
        for (c0, c1), i in cols:
            if c0 < at:
                clash = [prog.ids[j] for (a, b), j in cols if a < c1 and c0 < b and j != i][:1]
                out.append(Finding("coverage", f"{name}: rows [{lo}, {hi}) x [{c0}, {at}) produced twice "
                                   f"({prog.label(i)} and #{clash[0] if clash else '?'})",
                                   [prog.ids[i], *clash], prog.path(i)))
                return out
            if c0 > at:
                break
            at = c1
        if at < k1:
            msg = f"[{at}, {k1})" if (k0, k1) != (0, 1) else ""
            out.append(Finding("coverage", f"{name}: rows [{lo}, {hi}){' x ' + msg if msg else ''} are produced by "
                               "no instruction", []))
            return out
    return out


def _qk_norm_findings(prog: Program, qk_apart: set[int]) -> list[Finding]:
    """Each q head of a QK-norm model is normalised exactly once: where QKV left it unnormalised
    (attn_norm_qkv_rope_sq), either by its group's qk_norm_apply (without `k_only`) or by every attention split of the
    group (attn_partial `qk_norm` 1), never both and never neither; elsewhere attention must not normalise it again."""
    apply_q = {(prog.layer[i], prog.args[i]["kv_head"]): (1 - prog.args[i].get("k_only", 0), i)
               for i in range(prog.n) if prog.op[i] == "qk_norm_apply"}
    out: list[Finding] = []
    seen: set[tuple] = set()
    for i in range(prog.n):
        if prog.op[i] != "attn_partial":
            continue
        layer, g, flag = prog.layer[i], prog.args[i]["kv_head"], prog.args[i].get("qk_norm", 0)
        if (layer, g) in seen:
            continue
        if layer not in qk_apart:
            if flag:
                seen.add((layer, g))
                out.append(Finding("coverage", f"{prog.label(i)} normalises q and the new k row (qk_norm 1), but "
                                   f"layer {layer}'s QKV is attn_norm_qkv_rope, which already did", [prog.ids[i]],
                                   prog.path(i)))
            continue
        if (layer, g) not in apply_q:  # the missing qk_norm_apply is a coverage finding of its own
            continue
        q, j = apply_q[(layer, g)]
        if q + flag != 1:
            seen.add((layer, g))
            out.append(Finding("coverage", f"{prog.label(i)} has qk_norm {flag} and {prog.label(j)} has k_only "
                               f"{1 - q}: the q heads of kv_head {g} would be normalised {'twice' if q else 'never'}",
                               [prog.ids[i], prog.ids[j]], prog.path(i)))
    return out


def check_coverage(prog: Program) -> list[Finding]:
    """Findings for missing or duplicated outputs, and split counts that attn_reduce and attn_partial disagree on."""
    geo = prog.geometry
    if geo is None:
        return []
    tiles: dict[tuple, list] = defaultdict(list)
    domains: dict[tuple, tuple] = {}
    findings: list[Finding] = []
    for i in range(prog.n):
        spec = OPS.get(prog.op[i])
        if spec is None:
            continue
        layer = prog.layer[i] if prog.layer[i] is not None else -1
        key, rect, domain = spec.tile(geo, layer, prog.args[i])
        if domains.setdefault(key, domain) != domain:
            findings.append(Finding("coverage", f"{prog.label(i)}: its args say the output is "
                                    f"{domain}, another instruction of the same op says {domains[key]}",
                                    [prog.ids[i]], prog.path(i)))
            continue
        tiles[key].append((rect, i))
    unfused = {prog.layer[i] for i in range(prog.n) if prog.op[i] == "o_proj_residual"}
    qk_apart = {prog.layer[i] for i in range(prog.n) if prog.op[i] == "attn_norm_qkv_rope_sq"}
    for key in required_tiles(geo, unfused, qk_apart):
        if key not in tiles:
            findings.append(Finding("coverage", f"{_key_name(key)}: no instruction produces it", []))
    for key, ts in tiles.items():
        findings.extend(_partition_findings(key, domains[key], ts, prog))
    if geo.cfg.qk_norm:
        findings.extend(_qk_norm_findings(prog, qk_apart))
    # attn_reduce (or o_proj with the merge folded in) must merge exactly the splits attn_partial produced for its
    # heads.
    group, hd = geo.cfg.group_size, geo.cfg.hd
    for i in range(prog.n):
        if prog.op[i] not in MERGE_OPS:
            continue
        a = prog.args[i]
        h0, h1 = (a["k_start"] // hd, a["k_end"] // hd) if prog.op[i] == FUSED_OPROJ else (a["start"], a["end"])
        seqs = [()] if geo.batch == 1 else [(b,) for b in sequences(geo, prog.op[i], a)]
        for g in range(h0 // group, (h1 + group - 1) // group):
            for b in seqs:
                dom = domains.get(("attn_partial", prog.layer[i], g, *b))
                if dom is not None and dom[0][1] != a["splits"]:
                    findings.append(Finding("coverage", f"{prog.label(i)} merges {a['splits']} splits but "
                                            f"attn_partial of kv_head {g} produces {dom[0][1]}", [prog.ids[i]],
                                            prog.path(i)))
                    break
    return findings
