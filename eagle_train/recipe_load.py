"""Loading a recipe: defaults, the YAML file and `key=value` overrides merged over the schema of
eagle_train.recipe, misspelled keys explained, and `validate`, which checks each field's declared
rule (`spec`) and the cross-field rules, collects every problem and raises them all at once."""

from __future__ import annotations

import difflib
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import List, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagle_train.recipe import CHECKS, Recipe, RecipeError, TrainConfig


def _specs():
    """(key path, one_of, check, aliases) of every field declared with `spec`."""
    for section in fields(Recipe):
        if is_dataclass(section.default_factory):
            for f in fields(section.default_factory):
                if f.metadata:
                    yield f"{section.name}.{f.name}", f.metadata["one_of"], f.metadata["check"], f.metadata["aliases"]


def _apply_aliases(node: DictConfig) -> None:
    """Replace aliased values (`train.resume=auto`) in a loaded YAML or command-line node, in place."""
    for key, _, _, aliases in _specs():
        value = OmegaConf.select(node, key, default=None, throw_on_missing=False)
        if aliases and isinstance(value, (str, bool, int, float)) and value in aliases:
            OmegaConf.update(node, key, aliases[value], merge=False)


def _known_keys(node, prefix=""):
    keys = []
    for k in node.keys():
        path = f"{prefix}{k}"
        keys.append(path)
        v = node._get_node(k)
        if isinstance(v, DictConfig) and not path.startswith("train.deepspeed"):
            keys += _known_keys(v, path + ".")
    return keys


def _explain(err: OmegaConfBaseException, schema, where: str) -> str:
    key = getattr(err, "full_key", None) or "?"
    msg = (getattr(err, "msg", None) or str(err)).splitlines()[0]
    hint = ""
    near = difflib.get_close_matches(key, _known_keys(schema), n=1)
    if near and near[0] != key and "did you mean" not in msg.lower():
        hint = f" (did you mean `{near[0]}`?)"
    return f"{where}: recipe key `{key}`: {msg}{hint}"


def load_recipe(path: str | Path | None, overrides: List[str] = ()) -> DictConfig:
    """Merge defaults, the YAML at `path` and `key=value` overrides; validate; resolve `${...}`."""
    schema = OmegaConf.structured(Recipe)
    cfg, where = schema, "defaults"
    try:
        if path is not None:
            where = str(path)
            if not Path(path).is_file():
                raise RecipeError(f"recipe file not found: {path} (recipes live in recipes/*.yaml)")
            try:
                loaded = OmegaConf.load(path)
            except yaml.YAMLError as err:  # syntax errors and duplicate keys: name the file, no traceback
                raise RecipeError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
            _check_sections(loaded, schema, where)
            _apply_aliases(loaded)
            cfg = OmegaConf.merge(cfg, loaded)
        if overrides:
            where = f"{path or 'defaults'} with command-line overrides"
            dotlist = OmegaConf.from_dotlist([_check_override(o, where) for o in overrides])
            _check_sections(dotlist, schema, where)
            _apply_aliases(dotlist)
            cfg = OmegaConf.merge(cfg, dotlist)
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        raise RecipeError(_explain(err, schema, where)) from None
    validate(cfg, where)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _check_sections(loaded, schema, where: str) -> None:
    """A recipe is a mapping of sections, each a mapping of keys: say so instead of a merge error."""
    if not isinstance(loaded, DictConfig):
        raise RecipeError(f"{where}: the top level must be a mapping of sections (target:, data:, train:, ...), "
                          f"got a {type(loaded).__name__.replace('Config', '').lower()}")
    for key in loaded.keys():
        section = schema._get_node(key) if key in schema else None
        if isinstance(section, DictConfig) and key != "train.deepspeed":
            value = loaded._get_node(key)
            if not isinstance(value, DictConfig) and not OmegaConf.is_missing(loaded, key):
                raise RecipeError(f"{where}: recipe key `{key}` is a section and must be a mapping of keys "
                                  f"(e.g. {key}.<key>=...), got {value._value()!r}")


def _check_override(item: str, where: str) -> str:
    key = item.split("=", 1)[0]
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"{where}: override {item!r} is not `section.key=value` (empty key or key part)")
    return item


def validate(cfg: DictConfig, where: str = "recipe") -> None:
    """Each field's declared rule, then the cross-field checks; every problem names its key path, the
    value and the fix."""
    problems = []
    for key in _missing_keys(cfg):
        problems.append(f"`{key}` is required and has no value (set it in the recipe or as {key}=...)")
    for key, one_of, check, _ in _specs():  # the rules declared beside each field
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        if value is None:
            continue
        if one_of is not None and value not in one_of:
            problems.append(f"`{key}` = {value!r} is not one of {', '.join(map(str, one_of))}")
        values = list(value) if OmegaConf.is_list(value) else [value]
        if check is not None and not all(CHECKS[check](v) for v in values):
            shown = list(value) if OmegaConf.is_list(value) else value
            problems.append(f"`{key}` = {shown} must be {check.replace('finite', 'a finite number')}")
    if cfg.head.aux_layers is not None and len(cfg.head.aux_layers) != 3:
        problems.append(f"`head.aux_layers` = {list(cfg.head.aux_layers)} must list 3 layers (low, mid, high)")
    elif cfg.head.aux_layers is not None and min(cfg.head.aux_layers) < 1:  # -1 would read the last layer
        problems.append(f"`head.aux_layers` = {list(cfg.head.aux_layers)}: indices count from 1 (HF hidden_states, "
                        "0 = embeddings, which no engine captures); negative indices are not allowed")
    if len(cfg.train.adam_betas) != 2 or not all(0 <= b < 1 for b in cfg.train.adam_betas):
        problems.append(f"`train.adam_betas` = {list(cfg.train.adam_betas)} must be two numbers in [0, 1)")
    if cfg.data.prompt_template is not None:
        from eagle_train.data_prep.readers import template_fields

        try:
            names = template_fields(cfg.data.prompt_template)
        except ValueError as err:
            names = {f"malformed: {err}"}
        if not names or not names <= {"user", "assistant"}:
            problems.append(f"`data.prompt_template` = {cfg.data.prompt_template!r} must name {{user}} and/or "
                            f"{{assistant}} and no other field (found: {sorted(names) or 'none'}); write a literal "
                            "brace as {{ or }}")
    if cfg.train.deep_learning_rate > 0 and not 0 < cfg.train.shallow_steps < cfg.train.max_steps:
        problems.append(f"`train.deep_learning_rate` = {cfg.train.deep_learning_rate} restarts the schedule at "
                        f"`train.shallow_steps` = {cfg.train.shallow_steps}, which must lie between 0 and "
                        f"`train.max_steps` = {cfg.train.max_steps}; set both or drop train.deep_learning_rate")
    if cfg.train.shallow_steps > 0 and cfg.train.shallow_ttt > cfg.train.ttt_steps:
        problems.append(f"`train.shallow_ttt` = {cfg.train.shallow_ttt} > `train.ttt_steps` = {cfg.train.ttt_steps}: the "
                        "early steps are meant to unroll fewer TTT steps, not more; lower train.shallow_ttt")
    if cfg.head.type == "eagle1":  # EAGLE-3's TTT unroll only: EAGLE-1/2 trains one step (its regularizer: train.noise)
        off = TrainConfig()  # their defaults: off
        for key in ("ttt_rows", "step0_rows", "dropout"):
            if cfg.train[key] != getattr(off, key):
                problems.append(f"`train.{key}` = {cfg.train[key]} applies to EAGLE-3 heads, but `head.type` = "
                                f"'eagle1': drop it (EAGLE-1/2's feature noise is train.noise)")
    if cfg.eval.tree == "dynamic" and cfg.eval.num_draft_tokens < cfg.eval.depth:
        problems.append(f"`eval.num_draft_tokens` = {cfg.eval.num_draft_tokens} < `eval.depth` = {cfg.eval.depth}: "
                        "a dynamic tree keeps at most that many nodes, so it never reaches that depth; "
                        f"set eval.num_draft_tokens >= {cfg.eval.depth} or eval.depth <= {cfg.eval.num_draft_tokens}")
    for i, tree in enumerate(cfg.eval.sweep_trees):
        if len(tree) != 3 or min(tree) < 1:
            problems.append(f"`eval.sweep_trees[{i}]` = {list(tree)} must be [topk, depth, num_draft_tokens], "
                            "three numbers > 0, e.g. [10, 6, 60]")
    if cfg.eval.tree == "static" and not cfg.eval.static_tree:
        problems.append("`eval.tree` = 'static' needs `eval.static_tree` (a list of paths, e.g. [[0], [1], [0, 0]])")
    named_init = cfg.head.init in ("none", "lm_head", "last_layer")  # else a head folder to start from
    if not named_init and not Path(cfg.head.init).expanduser().is_dir():
        problems.append(f"`head.init` = {cfg.head.init!r} is not one of none, lm_head, last_layer, nor a head folder")
    if cfg.head.draft_vocab_swap and named_init:
        problems.append(f"`head.draft_vocab_swap` = {cfg.head.draft_vocab_swap} re-ranks a trained head's draft "
                        f"vocabulary: set `head.init` to a head folder (it is {cfg.head.init!r})")
    if problems:
        raise RecipeError(f"{where}: {len(problems)} problem(s) in the recipe:\n  - " + "\n  - ".join(problems))


def _missing_keys(cfg: DictConfig, prefix: str = "") -> List[str]:
    out = []
    for k in cfg.keys():
        path = f"{prefix}{k}"
        if OmegaConf.is_missing(cfg, k):
            out.append(path)
            continue
        v = cfg._get_node(k)
        if isinstance(v, DictConfig):
            out += _missing_keys(v, path + ".")
    return out


def split_args(argv: List[str]) -> tuple[Optional[str], List[str]]:
    """`recipe.yaml k=v ...` -> (path, overrides); the recipe path is the one arg without `=`."""
    paths = [a for a in argv if "=" not in a]
    if len(paths) > 1:
        raise RecipeError(f"expected one recipe file and key=value overrides, got {paths}")
    return (paths[0] if paths else None), [a for a in argv if "=" in a]
