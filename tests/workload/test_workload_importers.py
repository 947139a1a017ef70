"""Azure LLM-inference CSV and ShareGPT JSON importers, on small samples written here."""

import json

import pytest

from computron.workload import (Pairs, TraceFormatError, make_workload, parse_timestamp_ns,
                                read_azure_csv, read_sharegpt, sharegpt_pairs)

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2506630,879,2
2023-11-16 18:16:00.0000000,91,0
2023-11-16 19:15:46.680590012,1000,23
"""


def test_azure_csv_relative_times_and_lengths(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    t = read_azure_csv(path, model="code")
    assert len(t) == 5 and t.models == ["code"]
    expected = [0.0, 4.314579, 4.570073, 13.31941, 3600.000000012]
    assert [r.time for r in t] == pytest.approx(expected, abs=1e-9)
    assert [(r.prompt_tokens, r.output_tokens) for r in t] == [
        (374, 44), (396, 109), (879, 2), (91, 0), (1000, 23)]
    assert len(read_azure_csv(path, limit=2)) == 2


def test_azure_csv_relative_to_earliest_and_crlf_bom(tmp_path):
    path = tmp_path / "azure.csv"
    rows = AZURE.strip().splitlines()
    path.write_bytes(("\ufeff" + "\r\n".join([rows[0], rows[2], rows[1]]) + "\r\n").encode())
    t = read_azure_csv(path)
    # the file's first row (18:15:50.99) is not its earliest (18:15:46.68): no negative times
    assert [r.time for r in t] == pytest.approx([0.0, 4.314579], abs=1e-9)
    assert [r.prompt_tokens for r in t] == [374, 396]


def test_timestamp_digits():
    a = parse_timestamp_ns("2023-11-16 18:15:46.6805900")
    assert parse_timestamp_ns("2023-11-16T18:15:46.68059") == a
    assert parse_timestamp_ns("2023-11-16 18:15:46.68059001234") - a == 12  # >9 digits truncated
    assert parse_timestamp_ns("2023-11-16 18:15:47") - a == 319_410_000
    assert parse_timestamp_ns("2023-11-16 19:15:46.6805900+01:00") == a


@pytest.mark.parametrize("row, message", [
    ("yesterday,1,2", "bad timestamp"),
    ("2023-11-16 18:15:46.1,ten,2", "invalid literal"),
    ("2023-11-16 18:15:46.1,10,-2", ">= 0"),
    ("2023-11-16 18:15:46.1,10", "int()"),
])
def test_azure_csv_errors_name_the_line(tmp_path, row, message):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,1,1\n" + row + "\n")
    with pytest.raises(TraceFormatError) as e:
        read_azure_csv(path)
    assert f"{path}:3:" in str(e.value) and message in str(e.value)


def test_azure_csv_missing_column(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.0,1\n")
    with pytest.raises(TraceFormatError, match="missing column.*GeneratedTokens"):
        read_azure_csv(path)


SHAREGPT = [
    {"id": "x", "conversations": [
        {"from": "human", "value": "hello there"},
        {"from": "gpt", "value": "hi how are you"},
        {"from": "human", "value": "one two three"},
        {"from": "gpt", "value": "four"},
    ]},
    {"id": "y", "conversations": [
        {"from": "gpt", "value": "unprompted greeting"},    # no human before: skipped
        {"from": "human", "value": "a"},                     # followed by a human: skipped
        {"from": "human", "value": "b c d e f"},
        {"from": "gpt", "value": "g h"},
        {"from": "human", "value": "trailing question"},     # no gpt after: skipped
    ]},
    {"id": "z", "conversations": []},
]


def test_sharegpt_pairs_turns(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    assert read_sharegpt(path) == [(2, 4), (3, 1), (5, 2)]
    assert read_sharegpt(path, tokenizer=lambda s: list(s)) == [(11, 14), (13, 4), (9, 3)]
    assert read_sharegpt(path, tokenizer=len) == [(11, 14), (13, 4), (9, 3)]  # an int count
    # pairs feed make_workload
    t = make_workload(["m"], rate=20.0, duration=10.0, lengths=Pairs(read_sharegpt(path)), seed=0)
    assert {(r.prompt_tokens, r.output_tokens) for r in t} <= {(2, 4), (3, 1), (5, 2)}


def test_sharegpt_errors(tmp_path):
    with pytest.raises(TraceFormatError, match="entry 1"):
        sharegpt_pairs([{"conversations": []}, {"id": 2}])
    with pytest.raises(TraceFormatError, match="entry 0, turn 1"):
        sharegpt_pairs([{"conversations": [{"from": "human", "value": "x"}, {"from": "gpt"}]}])
    with pytest.raises(TraceFormatError, match="JSON list"):
        sharegpt_pairs({"conversations": []})
    path = tmp_path / "broken.json"
    path.write_text('[\n{"conversations": [\n}')
    with pytest.raises(TraceFormatError, match=f"{path}:3:"):
        read_sharegpt(path)
