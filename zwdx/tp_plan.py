"""A TP job's plan: which modules of the model are split over a TP group, and how.

The submitter's (``tp_plan={"blocks.*.mlp.up": "colwise", ...}``) is resolved against the model:
each name, where ``*`` stands for one part of a module's name (as ``parallelize_module`` matches
them), must name at least one ``nn.Linear`` or ``nn.Embedding``. Left out, a plan is derived
(``derive``), for the layouts torchtitan's ``parallelize`` handles for llama and the PyTorch TP
tutorial shows: in every module, its direct ``nn.Linear`` children that form a pair, the ones
feeding it split by output features (``colwise``: an MLP's up and gate projections, attention's
q, k and v) and the one they feed split by input features (``rowwise``: the down projection,
attention's output). A pair is told first by shapes: an output h -> d with h > d, fed by the
Linear children that map d -> h (an MLP, gated or not); then by name, where shapes cannot tell
(attention's q, k, v and o are all d -> d): an output named ``o_proj``, ``out_proj``, ``wo``,
``c_proj``, ``proj``, ``dense``, ..., fed by the others that read d and make at most its input
(q, k and v, also with fewer key/value heads). A fused q/k/v (d -> 3d, split after) is left
whole: split by columns, its q, k and v parts would not be split alike. Embeddings and the
final head stay whole (replicated) in the derived plan.

The SDK resolves the plan before it uploads (a ``BadRequest`` naming ``tp_plan``, or a model with
no pair for a derived plan naming the model); the ranks resolve it again and apply it
(``gpu_client/rank/strategies/tensor_parallel.py``), checking that every split size divides by the TP group's.
"""
from __future__ import annotations

from fnmatch import fnmatchcase

#: Names of the Linear an attention block's q, k, v feed (its output projection), for square pairs.
OUTPUT_NAMES = ("o_proj", "out_proj", "wo", "o", "c_proj", "proj", "dense", "out", "output", "down_proj",
                "down", "w2", "fc2", "fc_out")


def matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` matches a plan's ``pattern`` part by part (``*`` is one part)."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(fnmatchcase(p, w) for p, w in zip(parts, wanted))


def resolve(model, plan: dict) -> dict[str, str]:
    """The submitter's ``plan`` as ``{module name: "colwise" | "rowwise"}`` over ``model``'s modules;
    ``ValueError`` naming the entry that names no module, or a module that is neither an
    ``nn.Linear`` nor an ``nn.Embedding``, or one module named twice."""
    from torch import nn
    modules = [(name, m) for name, m in model.named_modules() if name]
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        style = getattr(style, "value", style)
        if style not in ("colwise", "rowwise"):
            raise ValueError(f"{pattern!r}: the style must be 'colwise' or 'rowwise', got {style!r}")
        hits = [(name, m) for name, m in modules if matches(name, pattern)]
        if not hits:
            raise ValueError(f"{pattern!r} names no module of {type(model).__name__} (e.g. "
                             f"{', '.join(repr(n) for n, _ in modules[:3])})")
        for name, module in hits:
            if not isinstance(module, (nn.Linear, nn.Embedding)):
                raise ValueError(f"{pattern!r} names {name}, a {type(module).__name__}: only nn.Linear and "
                                 f"nn.Embedding modules are split")
            if name in out:
                raise ValueError(f"{name} is named twice (by {pattern!r} and an earlier entry)")
            out[name] = style
    return out


def derive(model) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """A plan derived from ``model`` (see the module's docstring): ``({name: style}, [(module, why
    (some of) its Linear children were left whole)])``, in the model's order. A pair that shares
    a parameter with another module (tied weights) is left whole."""
    from torch import nn
    owners: dict[int, set[str]] = {}
    order: dict[str, int] = {}
    for name, module in model.named_modules():
        order[name] = len(order)
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(name)
    plan: dict[str, str] = {}
    skipped: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        linears = [(child, m) for child, m in module.named_children() if type(m) is nn.Linear]
        if len(linears) < 2:
            continue
        pairs, why = _pairs(linears)
        prefix = f"{name}." if name else ""
        if why:
            skipped.append((name or type(model).__name__, why))
        children = dict(linears)
        for output, feeders in pairs:
            tied = [c for c in (output, *feeders) if any(len(owners[id(p)]) > 1 for p in children[c].parameters())]
            if tied:
                skipped.append((prefix + tied[0], "shares a weight with another module"))
                continue
            plan.update({prefix + c: "colwise" for c in feeders})
            plan[prefix + output] = "rowwise"
    return dict(sorted(plan.items(), key=lambda item: order[item[0]])), skipped


def _pairs(linears: list) -> tuple[list[tuple[str, list[str]]], str]:
    """The pairs among a module's Linear children, ``[(output, [its feeders])]``, and why some
    were left whole. First by shapes: an output h -> d (h > d) fed by every other d -> h (an MLP's
    down projection and its up and gate projections); then by name: an output of ``OUTPUT_NAMES``
    fed by the others that read d and make at most its input (attention's q, k, v, also with
    fewer key/value heads; a fused q/k/v, which makes more, is left whole)."""
    left = dict(linears)
    pairs = []
    for by_name in (False, True):
        for out, d in linears:
            if out not in left or (out not in OUTPUT_NAMES if by_name else d.in_features <= d.out_features):
                continue
            feeders = [c for c, x in left.items() if c != out and x.in_features == d.out_features and
                       (x.out_features <= d.in_features if by_name else x.out_features == d.in_features)]
            if feeders:
                pairs.append((out, feeders))
                for c in (out, *feeders):
                    left.pop(c)
    square = [c for c, x in left.items() if x.in_features == x.out_features]
    why = ""
    if len(square) > 1 and not pairs:
        why = (f"cannot tell which of {', '.join(square)} is the output projection (name it o_proj, out_proj, wo "
               f"or c_proj, or give tp_plan)")
    return pairs, why


#: Attributes of an attention module that hold a head count (nanoGPT, llama, Hugging Face, torch).
HEAD_COUNTS = ("n_head", "n_heads", "num_heads", "nhead", "heads", "n_kv_heads", "num_attention_heads",
               "num_key_value_heads")


def whole_heads(model, plan: dict[str, str], size: int) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """A derived ``plan`` without the modules whose parent's head count (``HEAD_COUNTS``) a TP
    group of ``size`` cannot split into whole heads, and those parents with why: DTensor cannot
    view a split of part of a head as heads (``x.view(B, T, n_head, head_dim)``)."""
    modules = dict(model.named_modules())
    kept, skipped = {}, []
    bad: dict[str, str] = {}
    for name, style in plan.items():
        parent = name.rpartition(".")[0]
        if parent not in bad:
            counts = [(a, getattr(modules[parent], a, None)) for a in HEAD_COUNTS]
            odd = [(a, n) for a, n in counts if isinstance(n, int) and not isinstance(n, bool) and n % size]
            bad[parent] = f"{odd[0][0]}={odd[0][1]} does not divide by the TP size {size}" if odd else ""
            if odd:
                skipped.append((parent or type(model).__name__, bad[parent]))
        if not bad[parent]:
            kept[name] = style
    return kept, skipped


def split_sizes(model, plan: dict[str, str], size: int) -> list[str]:
    """The modules of ``plan`` whose split dimension ``size`` does not divide, with their sizes."""
    from torch import nn
    modules = dict(model.named_modules())
    bad = []
    for name, style in plan.items():
        m = modules[name]
        if isinstance(m, nn.Embedding):
            n = m.num_embeddings if style == "rowwise" else m.embedding_dim
        else:
            n = m.out_features if style == "colwise" else m.in_features
        if n % size:
            bad.append(f"{name} ({style}: {n} features)")
    return bad


def left_whole(skipped: list[tuple[str, str]]) -> str:
    """``derive``'s skipped modules in words: ``left whole: blocks.0.attn (why), ...``."""
    return "left whole: " + ", ".join(f"{name} ({why})" for name, why in skipped) if skipped else ""


def no_pairs(model, parallelism: str, skipped: list[tuple[str, str]]) -> str:
    """Why a derived plan splits nothing of ``model``, and what to do."""
    return (f"{parallelism}: found no pair of Linear layers to split in {type(model).__name__} (an MLP's up and down "
            f"projections, attention's q/k/v and output){'; ' + left_whole(skipped) if skipped else ''}; give "
            f"tp_plan={{'module.name': 'colwise' | 'rowwise'}}")


def describe(plan: dict[str, str]) -> str:
    """The plan in a few words: ``4 colwise, 2 rowwise (blocks.0.attn.q, ... blocks.1.mlp.down)``."""
    if not plan:
        return "nothing split"
    names = list(plan)
    shown = names[0] if len(names) == 1 else f"{names[0]} ... {names[-1]}"
    counts = ", ".join(f"{sum(1 for s in plan.values() if s == style)} {style}" for style in ("colwise", "rowwise")
                       if style in plan.values())
    return f"{counts} ({shown})"


__all__ = ["OUTPUT_NAMES", "HEAD_COUNTS", "matches", "resolve", "derive", "whole_heads", "split_sizes", "left_whole",
           "no_pairs", "describe"]
