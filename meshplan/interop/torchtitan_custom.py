"""A torchtitan llama3 flavor for a dense Llama-style model torchtitan ships none of: what
``export --to torchtitan`` writes beside the job TOML (``model.flavor = "<the model's name>"``
and, in the ``.py`` of the same stem, the lines registering that flavor: :func:`snippet`), and
what a job TOML's reader takes back from that file (:func:`snippet_flavors`).

torchtitan v0.2.2 (pytorch/torchtitan e347b1e, the job TOML's target) looks a flavor up in
``train_spec.model_args[job_config.model.flavor]`` (``torchtitan/train.py``:138), for llama3
the dict ``llama3_args`` of ``torchtitan/models/llama3/__init__.py``:28 (flavors debugmodel,
its flex/varlen variants, 8B, 70B, 405B: :data:`SHIPPED`), after importing
``[experimental] custom_import`` (``train.py``:83-84): a module that adds an entry to that dict,
run there or appended to that ``__init__.py``, gives the job TOML its flavor.

Its ``TransformerModelArgs`` (``torchtitan/models/llama3/model/args.py``:28-45 at e347b1e)
states a model as ``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``, ``vocab_size``,
``multiple_of``, ``ffn_dim_multiplier``, ``norm_eps``, ``rope_theta``, ``max_seq_len``; the rest is
fixed in ``model/model.py``: head size ``dim // n_heads`` (:200), Linears without bias (:204-209,
338-340), SwiGLU FFN (w1, w2, w3), ``nn.RMSNorm`` (:382-383, 457), RoPE, an output Linear apart
from the embedding (:448, 458: untied), and the FFN width of :func:`llama3_ffn`. A model that
differs in any of these (MoE, MLA, biases, LayerNorm, q/k norms, tied embeddings, another head
size) is not a llama3 flavor (:func:`not_llama3`).
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any, NamedTuple, Optional

from meshplan.spec.model import ModelSpec

#: llama3's flavors at e347b1e (``torchtitan/models/llama3/__init__.py``:28-99): a custom flavor
#: never takes one of these names (it would replace torchtitan's).
SHIPPED = ("debugmodel", "debugmodel_flex_attn", "debugmodel_varlen_attn", "8B", "8B_flex", "8B_varlen", "70B",
           "405B")
#: ``TransformerModelArgs``' defaults (``model/args.py``:28-45 at e347b1e) of the fields a
#: snippet may leave out.
DEFAULTS: dict[str, Any] = {"n_kv_heads": None, "vocab_size": 128256, "multiple_of": 256,
                            "ffn_dim_multiplier": None, "norm_eps": 1e-5, "rope_theta": 10000, "max_seq_len": 131072}
#: The ``multiple_of`` values tried, largest first: powers of two up to 4096, the largest
#: torchtitan ships (70B, 405B).
MULTIPLES = tuple(2 ** k for k in range(12, -1, -1))
#: The most decimals of a ``ffn_dim_multiplier`` tried (torchtitan ships 1.3 and 1.2).
DECIMALS = 3
#: How every snippet meshplan writes begins (:func:`snippet`): ``export --force`` replaces a ``.py``
#: beside the job TOML only where it begins so (:func:`meshplan_snippet`).
SNIPPET_MARK = "# meshplan export: torchtitan llama3 flavor "


def llama3_ffn(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """torchtitan's SwiGLU hidden width (``FeedForward.__init__``, ``model/model.py``:332-336 at
    e347b1e, called with ``hidden_dim = 4 * dim``, :375-380): ``int(2 * 4 * dim / 3)``, times the
    multiplier (``int()`` again), rounded up to a multiple of ``multiple_of``.

    >>> llama3_ffn(4096, 1024, 1.3), llama3_ffn(8192, 4096, 1.3), llama3_ffn(16384, 4096, 1.2)
    (14336, 28672, 53248)
    """
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def solve_ffn(dim: int, ffn: int) -> Optional[tuple[int, float]]:
    """(``multiple_of``, ``ffn_dim_multiplier``) for which :func:`llama3_ffn` of ``dim`` is
    ``ffn`` exactly: the multiplier with the fewest decimals (0 to :data:`DECIMALS`), then the
    largest power of two (:data:`MULTIPLES`); None when none is. Each candidate is checked
    with the formula itself (float ``int()`` as torchtitan computes it).

    >>> solve_ffn(7168, 20480), solve_ffn(4096, 14336), solve_ffn(7168, 20481)
    ((4096, 1.0), (2048, 1.2), None)
    """
    base = int(2 * (4 * dim) / 3)
    for d in range(DECIMALS + 1):
        scale = 10 ** d
        for m in MULTIPLES:
            if ffn % m:
                continue
            lo = max(1, math.floor((ffn - m + 1) * scale / base) - 1)  # int(x * base) in (ffn - m, ffn]
            for k in range(lo, math.ceil((ffn + 1) * scale / base) + 2):
                x = k / scale
                if llama3_ffn(dim, m, x) == ffn:
                    return m, x
    return None


def not_llama3(model: ModelSpec) -> Optional[str]:
    """Why ``model`` is no torchtitan llama3 flavor (module docstring), None when it is one.

    >>> not_llama3(ModelSpec(layers=2, hidden=64, ffn=256, q_heads=4, vocab=8, qkv_bias=True))
    'qkv_bias: llama3 has no bias in its Linears (model.py:204-209 at e347b1e)'
    """
    arch = model.architecture()
    fixed = {"experts": (0, "MoE: llama3 is dense"), "q_lora_rank": (None, "MLA: llama3 attends with GQA"),
             "kv_lora_rank": (None, "MLA: llama3 attends with GQA"),
             "gated_mlp": (True, "llama3's FFN is SwiGLU (w1, w2, w3)"),
             "norm": ("rmsnorm", "llama3 normalises with nn.RMSNorm"),
             "linear_bias": (False, "llama3 has no bias in its Linears (model.py:338-340 at e347b1e)"),
             "qkv_bias": (False, "llama3 has no bias in its Linears (model.py:204-209 at e347b1e)"),
             "qk_norm": (False, "llama3 has no q/k norm"), "position_embedding": ("rope", "llama3 uses RoPE"),
             "tied_embeddings": (False, "llama3's output Linear is its own (model.py:458 at e347b1e)"),
             "head_dim": (model.hidden // model.q_heads if model.hidden % model.q_heads == 0 else 0,
                          f"llama3's head size is dim // n_heads = {model.hidden} // {model.q_heads}")}
    for key, (want, why) in fixed.items():
        if arch[key] != want:
            return f"{key}{'' if isinstance(arch[key], bool) else ' ' + str(arch[key])}: {why}"
    if solve_ffn(model.hidden, model.ffn) is None:
        return (f"ffn {model.ffn}: no multiple_of (a power of two up to 4096) and ffn_dim_multiplier (at most "
                f"{DECIMALS} decimals) give it from dim {model.hidden} in torchtitan's formula multiple_of x "
                f"ceil(int(ffn_dim_multiplier x int(2 x 4 x dim / 3)) / multiple_of) (model.py:332-336 at e347b1e)")
    return None


class Flavor(NamedTuple):
    """A llama3 flavor meshplan writes: its name and ``TransformerModelArgs`` keywords, in order."""

    name: str
    args: dict[str, Any]


def llama3_flavor(model: ModelSpec) -> Optional[Flavor]:
    """The llama3 flavor of ``model`` (None where :func:`not_llama3` says why not): named after the
    model (``meshplan-`` before a name torchtitan ships, :data:`SHIPPED`), its sizes, the FFN solved
    (:func:`solve_ffn`), ``norm_eps``, ``rope_theta`` and ``max_seq_len`` (the model's
    ``max_position``) where the model states them.

    >>> m = ModelSpec(name="8B", layers=2, hidden=64, ffn=256, q_heads=4, kv_heads=2, vocab=8)
    >>> llama3_flavor(m)
    Flavor(name='meshplan-8B', args={'dim': 64, 'n_layers': 2, 'n_heads': 4, 'n_kv_heads': 2, 'vocab_size': 8, 'multiple_of': 256, 'ffn_dim_multiplier': 1.0})
    """
    if not_llama3(model) is not None:
        return None
    multiple, mult = solve_ffn(model.hidden, model.ffn) or (0, 0.0)
    args: dict[str, Any] = {"dim": model.hidden, "n_layers": model.layers, "n_heads": model.q_heads,
                            "n_kv_heads": model.kv_heads or model.q_heads, "vocab_size": model.vocab,
                            "multiple_of": multiple, "ffn_dim_multiplier": mult}
    args |= {k: v for k, v in (("norm_eps", model.norm_eps), ("rope_theta", model.rope_theta),
                               ("max_seq_len", model.max_position)) if v}
    return Flavor(f"meshplan-{model.name}" if model.name in SHIPPED else model.name, args)


def snippet(flavor: Flavor, toml_name: str) -> str:
    """The Python file registering ``flavor`` in torchtitan's ``llama3_args`` (module docstring),
    for the job TOML ``toml_name``; a header of comments says where it goes and shows the FFN
    arithmetic (:func:`llama3_ffn`)."""
    a = flavor.args
    base = int(2 * (4 * a["dim"]) / 3)
    inner = int(a["ffn_dim_multiplier"] * base)
    ffn = llama3_ffn(a["dim"], a["multiple_of"], a["ffn_dim_multiplier"])
    body = "".join(f"    {k}={v!r},\n" for k, v in a.items())
    return (f"{SNIPPET_MARK}{flavor.name!r} of {toml_name} (model.flavor), for "
            f"torchtitan <= v0.2.2 (e347b1e).\n"
            f"# Run it before the trainer builds the model: [experimental] custom_import = this module (its folder "
            f"on PYTHONPATH), or append it to torchtitan/models/llama3/__init__.py.\n"
            f"# FFN (model.py:332-336): int(2 x 4 x {a['dim']} / 3) = {base}; int({a['ffn_dim_multiplier']} x "
            f"{base}) = {inner}; {a['multiple_of']} x ceil({inner} / {a['multiple_of']}) = {ffn}\n"
            "from torchtitan.models.llama3 import llama3_args\n"
            "from torchtitan.models.llama3.model.args import TransformerModelArgs\n\n"
            f"llama3_args[{flavor.name!r}] = TransformerModelArgs(\n{body})\n")


def meshplan_snippet(text: str) -> bool:
    """Whether ``text`` is a flavor file meshplan wrote (it begins with :data:`SNIPPET_MARK`): the only
    ``.py`` an export with ``--force`` replaces (a ``train.py`` beside ``-o train.toml`` is the user's).

    >>> meshplan_snippet(snippet(Flavor("m", {"dim": 64, "multiple_of": 256, "ffn_dim_multiplier": 1.0}), "m.toml"))
    True
    >>> meshplan_snippet("import torch")
    False
    """
    return text.startswith(SNIPPET_MARK)


def snippet_flavors(text: str) -> dict[str, dict[str, Any]]:
    """flavor -> meshplan [model] table of each ``llama3_args["NAME"] = TransformerModelArgs(...)``
    in ``text`` (Python, read with :mod:`ast`, never run) whose keywords are all literals; a file
    that does not parse, or holds none, gives none (:func:`args_table`).

    >>> f = llama3_flavor(ModelSpec(name="m", layers=2, hidden=64, ffn=256, q_heads=4, vocab=8))
    >>> snippet_flavors(snippet(f, "m.toml"))["m"]["ffn"]
    256
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return {}
    out = {}
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Call)):
            continue
        target, call = node.targets[0], node.value
        if not (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                and target.value.id == "llama3_args" and isinstance(call.func, ast.Name)
                and call.func.id == "TransformerModelArgs" and not call.args):
            continue
        try:
            name = ast.literal_eval(target.slice)
            args = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg is not None}
        except ValueError:
            continue
        if isinstance(name, str) and len(args) == len(call.keywords) and _sizes_ok(args):
            out[name] = args_table(name, args)
    return out


def _sizes_ok(args: dict[str, Any]) -> bool:
    """Whether ``args`` are ``TransformerModelArgs`` keywords meshplan reads: dim, n_layers and n_heads
    given, every key one of :data:`DEFAULTS` or those, every value a number > 0 (None where
    torchtitan's default is None), the sizes whole numbers.

    >>> _sizes_ok({"dim": 64, "n_layers": 2, "n_heads": 4}), _sizes_ok({"dim": "64", "n_layers": 2, "n_heads": 4})
    (True, False)
    """
    sizes = {"dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "max_seq_len"}
    if not {"dim", "n_layers", "n_heads"} <= set(args) <= set(DEFAULTS) | sizes:
        return False
    return all(v is None and DEFAULTS.get(k, 0) is None or not isinstance(v, bool) and (
        isinstance(v, int) or isinstance(v, float) and k not in sizes) and v > 0 for k, v in args.items())


def args_table(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The meshplan [model] table of the llama3 model torchtitan builds of ``TransformerModelArgs``
    keywords ``args`` (:data:`DEFAULTS` for the ones left out; ``max_seq_len`` left out: no
    ``max_position``, as torchtitan sets it to ``training.seq_len``)."""
    a = DEFAULTS | {"max_seq_len": 0} | args
    return {"name": name, "layers": a["n_layers"], "hidden": a["dim"],
            "ffn": llama3_ffn(a["dim"], a["multiple_of"], a["ffn_dim_multiplier"]), "q_heads": a["n_heads"],
            "kv_heads": a["n_kv_heads"] or a["n_heads"], "head_dim": a["dim"] // a["n_heads"],
            "vocab": a["vocab_size"], "max_position": a["max_seq_len"], "rope_theta": float(a["rope_theta"]),
            "norm_eps": float(a["norm_eps"]),
            "source": f"torchtitan llama3 flavor {name!r}: TransformerModelArgs({', '.join(f'{k}={v!r}' for k, v in args.items())})"}


def sibling_flavors(job: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(``"llama3"``, flavor) -> [model] table of the llama3 flavors the ``.py`` of the same stem
    beside the job TOML ``job`` registers (:func:`snippet_flavors`; what an export wrote there), each
    table's source naming that file; none where there is no such file or it cannot be read.

    >>> sibling_flavors(Path("/nonexistent/tt.toml"))
    {}
    """
    py = job.with_suffix(".py")
    try:
        text = py.read_text(encoding="utf-8") if py != job and py.is_file() else ""
    except (OSError, UnicodeDecodeError):
        return {}
    return {("llama3", k): v | {"source": f"{py}: {v['source']}"} for k, v in snippet_flavors(text).items()}


def written_flavors(flavor: Optional[Flavor]) -> dict[tuple[str, str], dict[str, Any]]:
    """The llama3 flavor the snippet of ``flavor`` registers, read back from that very text
    (:func:`snippet`, :func:`snippet_flavors`): what an export's round trip reads the job TOML with;
    none for None."""
    return {} if flavor is None else {("llama3", k): v for k, v in snippet_flavors(snippet(flavor, "")).items()}
