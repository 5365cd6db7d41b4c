"""The MoE shape (hidden size, routed experts, top-k) of a Hugging Face transformers model config:
read from a config.json, a dict or a loaded ``PretrainedConfig`` (``EpConfig.from_hf_config``).

The names differ across families, and several families' config classes resolve the common names
through their own aliases (``PretrainedConfig.attribute_map``: ernie4_5_moe's
``num_experts_per_tok`` is stored as ``moe_k``, kimi_linear's as ``num_experts_per_token``; the
config.json and ``to_dict()`` hold the stored name). Each field is looked up, first name present
wins, in:

1. the config class's own aliases of the common names (``attribute_map`` of the loaded config's
   class, or of transformers' class of the model_type when the other names miss and transformers
   is installed);
2. the names of the families in ``FAMILY_FIELDS`` (checked against transformers 5.25's config
   classes and the published config.json files of each family);
3. the common names (``FIELDS``).
"""

from __future__ import annotations

import json
import os

FIELDS = {
    "hidden": ("hidden_size", "d_model"),
    "num_experts": ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts"),
    "topk": ("num_experts_per_tok", "experts_per_token", "num_experts_per_token", "moe_k", "moe_topk",
             "top_k_experts", "moe_top_k"),
}
"""The names of each EpConfig field in the configs of the families checked (the common ones first)."""

LABELS = {"hidden": "hidden size", "num_experts": "routed experts", "topk": "top-k"}

COMMON = {"hidden": ("hidden_size",), "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
          "topk": ("num_experts_per_tok",)}
"""The common names that transformers' config classes alias (``attribute_map`` keys)."""

FAMILY_FIELDS = {
    # model_type: {field: names as its config.json and its config class store them}
    "ernie4_5_moe": {"num_experts": ("moe_num_experts",), "topk": ("moe_k",)},
    "ernie4_5_vl_moe_text": {"num_experts": ("moe_num_experts",), "topk": ("moe_k",)},
    "hunyuan_v1_moe": {"num_experts": ("num_experts",), "topk": ("moe_topk",)},  # moe_topk: one per layer
    "longcat_flash": {"num_experts": ("n_routed_experts",), "topk": ("moe_topk",)},  # zero experts not routed here
    "kimi_linear": {"num_experts": ("num_experts",), "topk": ("num_experts_per_token",)},
    "bailing_hybrid": {"num_experts": ("num_experts",), "topk": ("num_experts_per_token",)},
    "aria_text": {"num_experts": ("moe_num_experts",), "topk": ("moe_topk",)},
    "gemma4_text": {"num_experts": ("num_experts",), "topk": ("top_k_experts",)},
    "dbrx": {"hidden": ("d_model",), "num_experts": ("ffn_config.moe_num_experts",),
             "topk": ("ffn_config.moe_top_k",)},
}
"""Per-family names, tried before the common ones (dotted: a key of a nested dict)."""

MOE_TYPES = frozenset(FAMILY_FIELDS) - {"gemma4_text"} | {"qwen3_moe", "qwen3_next", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3",
                                        "kimi_k2", "gpt_oss", "llama4_text", "olmoe", "phimoe", "granitemoe",
                                        "glm4_moe", "dots1", "minimax", "jamba", "aria"}
"""Model types whose configs always describe routed experts (a missing field there is not a dense
model); gemma4 has a dense and a MoE form (``enable_moe_block``): its keys decide."""

SUB_CONFIGS = ("text_config", "thinker_config", "language_config", "llm_config")
"""Keys of a multimodal config's language model, read when the top level has no hidden size."""

MAX_DEPTH = 64
"""A config.json nests at most this many levels (published ones nest 3 or 4); deeper is refused."""


def _depth(value) -> int:
    """Nesting depth of a parsed JSON value (iterative: any depth)."""
    most, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            most = max(most, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return most


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list) -> dict:
    """A JSON object's dict; ``_DuplicateKey`` for a key given twice (``json`` keeps the last
    silently)."""
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def read_file(source) -> tuple[dict, str]:
    """(contents, ``where``: the call naming the file) of a config.json path, or of a directory's
    config.json.

    Raises:
        FileNotFoundError: neither a regular file nor a directory holding config.json (the message
            says which: missing, a directory without config.json, a dangling or looping link, or
            a device, pipe or socket).
        OSError: the file cannot be read (the message names it).
        ValueError: not UTF-8, not JSON, a key twice in one object, nested deeper than
            ``MAX_DEPTH``, or not an object; each message names the file and the rule.
    """
    given = os.fspath(source)
    path = os.path.join(given, "config.json") if os.path.isdir(given) else given
    where = f"EpConfig.from_hf_config({path!r})"
    if not os.path.isfile(path):
        if path != given and not os.path.lexists(path):
            why = "a directory with no config.json in it"
        else:
            if os.path.islink(path) and not os.path.exists(path):
                why = "a symbolic link to nothing (dangling, or a loop of links)"
            elif os.path.isdir(path):
                why = "a directory, not a file"
            elif os.path.exists(path):
                why = "not a regular file (a device, pipe or socket); pass a config.json or its model directory"
            else:
                why = "no such file or directory"
            why = why if path == given else f"a directory whose config.json is {why}"
        raise FileNotFoundError(f"EpConfig.from_hf_config({given!r}): {why}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise type(e)(e.errno, f"{where}: cannot read the file ({e.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); a config.json is "
                         "UTF-8 JSON") from None
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise ValueError(f"{where}: the key {e.args[0]!r} appears twice in one object; a config.json names each "
                         "field once (which value is meant is unknowable)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except ValueError as e:  # an integer past Python's digit limit (sys.set_int_max_str_digits)
        raise ValueError(f"{where}: not a config.json's JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested deeper than the parser takes; a config.json nests at most "
                         f"{MAX_DEPTH} levels") from None
    if _depth(data) > MAX_DEPTH:
        raise ValueError(f"{where}: JSON nested {_depth(data)} levels deep; a config.json nests at most {MAX_DEPTH} "
                         "levels")
    if not isinstance(data, dict):
        raise ValueError(f"{where}: the file holds a JSON {type(data).__name__}, not an object")
    return data, where


def _class_aliases(model_type) -> dict:
    """``attribute_map`` of transformers' config class of ``model_type``; {} without transformers
    (not imported here unless installed) or for a model_type it does not know."""
    if not isinstance(model_type, str):
        return {}
    try:
        from transformers import CONFIG_MAPPING
        return dict(getattr(CONFIG_MAPPING[model_type], "attribute_map", {}) or {})
    except Exception:  # not installed, or an unknown model_type: no aliases to add
        return {}


def _get(data: dict, name: str):
    for part in name.split("."):
        if not isinstance(data, dict):
            return None
        data = data.get(part)
    return data


def _has_hidden(data: dict, aliases: dict) -> bool:
    return any(_get(data, n) is not None for n in _names("hidden", data.get("model_type"), aliases))


def _names(field: str, model_type, aliases: dict) -> tuple[str, ...]:
    names = [aliases[n] for n in COMMON[field] if isinstance(aliases.get(n), str)]
    names += FAMILY_FIELDS.get(model_type, {}).get(field, ())
    names += FIELDS[field]
    return tuple(dict.fromkeys(names))


def moe_shape(source) -> tuple[dict, str, str]:
    """({"hidden", "num_experts", "topk"}: ints, model_type label, where) of ``source``: a path, a
    dict or an object with ``to_dict()`` (a PretrainedConfig).

    Raises:
        FileNotFoundError, OSError, ValueError: as ``read_file``; a source of another type; a field
            missing (the message names the field, every name looked for and the model_type, and
            calls the model dense only where nothing in it speaks of experts) or not a positive
            int (a per-layer list must hold one value).
    """
    obj = None
    if isinstance(source, (str, os.PathLike)):
        data, where = read_file(source)
    elif isinstance(source, dict):
        data, where = source, "EpConfig.from_hf_config(<dict>)"
    elif callable(getattr(source, "to_dict", None)):
        obj, data, where = source, source.to_dict(), f"EpConfig.from_hf_config(<{type(source).__name__}>)"
    else:
        raise ValueError(f"EpConfig.from_hf_config: source must be a path, a dict or a PretrainedConfig, got "
                         f"{type(source).__name__}")
    if not isinstance(data, dict):
        raise ValueError(f"{where}: to_dict() gave a {type(data).__name__}, not a dict")
    model_type = data.get("model_type") or "<no model_type>"
    label = model_type
    aliases = dict(getattr(type(obj), "attribute_map", {}) or {}) if obj is not None else {}
    for _ in range(3):  # a multimodal config: its language model's config (qwen3_omni_moe: two levels down)
        if _has_hidden(data, aliases):
            break
        key = next((k for k in SUB_CONFIGS if isinstance(data.get(k), dict)), None)
        if key is None:
            break
        data = data[key]
        obj = getattr(obj, key, None) if obj is not None else None
        aliases = dict(getattr(type(obj), "attribute_map", {}) or {}) if obj is not None else {}
        label = f"{label}.{key} ({data.get('model_type') or '<no model_type>'})"
    sub_type = data.get("model_type")
    fields = {}
    for field in FIELDS:
        names = _names(field, sub_type, aliases)
        found = [n for n in names if _get(data, n) is not None]
        if not found and not aliases:
            aliases = _class_aliases(sub_type)
            names = _names(field, sub_type, aliases)
            found = [n for n in names if _get(data, n) is not None]
        if not found:
            moe = sub_type in MOE_TYPES or model_type in MOE_TYPES or any(  # a key of experts set
                ("expert" in k or "moe" in k) and v not in (None, False, 0, [], {}) for k, v in data.items()
                if isinstance(k, str))
            why = (f"model_type {label!r} has routed experts: name the field as its config class does, or build "
                   "EpConfig(...) directly" if moe else "a dense model has no expert layers to dispatch to")
            raise ValueError(f"{where}: the config has no {LABELS[field]} field (EpConfig.{field}): looked for "
                             f"{', '.join(names)} in model_type {label!r}; {why}")
        name, value = found[0], _get(data, found[0])
        if isinstance(value, (list, tuple)) and value and all(v == value[0] for v in value):
            value = value[0]  # one value a layer (hunyuan_v1_moe's moe_topk), all the same
        elif isinstance(value, (list, tuple)) and not value:
            raise ValueError(f"{where}: model_type {label!r}: {name}=[] gives no {LABELS[field]} (a per-layer list "
                             "holds one value a layer)")
        elif isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: model_type {label!r}: {name}={value!r} differs across layers; an EpConfig "
                             f"holds one {LABELS[field]} (build one EpConfig(...) per distinct layer)")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: model_type {label!r}: {name}={value!r} must be a positive int (it gives "
                             f"EpConfig.{field})")
        fields[field] = value
    return fields, label, where

