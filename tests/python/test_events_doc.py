"""The event log's names are a contract (README.md, "The event log"): driver/events.h spells
each once, the README's table documents the same events, the tests' schema
(helpers.EVENT_SCHEMA) checks the same, and no other source of the driver spells one as a
string where it names an event (the first argument of an Event, Write or OnEvent call, or a
name compared with `==`): each use goes through the constant. A field or phase that happens to
share a name (the recovery phase "fence", the status field "straggler") is not an event's."""
import pathlib
import re

from helpers import EVENT_SCHEMA

ROOT = pathlib.Path(__file__).resolve().parents[2]


def declared():
    text = (ROOT / "driver/events.h").read_text()
    names = re.findall(r'inline constexpr char (k\w+)\[\] = "([a-z_]+)";', text)
    listed = re.findall(r"^\s+(k\w+),$", text[text.index("kAll[]"):], re.M)
    assert [k for k, _ in names] == listed, "kAll must list every name, in order"
    return [n for _, n in names]


def readme_events():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### The event log"):]
    table = section[section.index("| event | fields |"):]
    table = table[:table.index("\n\n")]
    out = []
    for line in table.splitlines()[2:]:
        first = line.split("|")[1]
        out += re.findall(r"`([a-z_]+)`", first)
    return out


def test_the_readme_and_the_schema_name_the_events_the_driver_declares():
    names = declared()
    assert len(names) == len(set(names)), names
    assert readme_events() == names  # the same events, in the same order
    assert set(EVENT_SCHEMA) == set(names), set(EVENT_SCHEMA) ^ set(names)


def test_no_other_driver_source_spells_an_event_name():
    names = declared()
    spelt = {}
    for folder in ("driver", "common", "rendezvous", "discovery"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".cc", ".h") or path.name == "events.h":
                continue
            text = path.read_text()
            found = [n for n in names
                     if re.search(r'(?:Event|Write|OnEvent)\(\s*"%s"|==\s*"%s"|"%s"\s*==' % (n, n, n),
                                  text)]
            if found:
                spelt[path.relative_to(ROOT).as_posix()] = found
    assert spelt == {}, spelt
