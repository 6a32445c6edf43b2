# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-selfspec project
"""The option schema: one definition per option drives validation, errors and the README table."""

import logging
import re
from pathlib import Path

import pytest

from vllm_selfspec import options
from vllm_selfspec.options import SelfAdmgConfigError, make_options, options_table

README = Path(__file__).parents[1] / "README.md"


def test_readme_option_table_is_the_schema():
    text = README.read_text()
    table = re.search(r"<!-- options-table:begin -->\n(.*?)\n<!-- options-table:end -->", text, re.S)
    assert table, "README.md lacks the options-table markers"
    assert table.group(1).strip() == options_table().strip(), (
        "README's option table differs from the schema: paste `python -m vllm_selfspec.options`"
    )


def test_public_and_experimental_options_are_apart():
    public = options_table()
    experimental = options_table(experimental=True)
    for name, spec in options.SPECS.items():
        assert (f"`{name}`" in experimental) == spec.experimental
        assert (f"`{name}`" in public) == (not spec.experimental)


def test_experimental_options_go_under_their_key():
    opts = make_options({"experimental": {"draft_vocab": 0, "lookup_max_match": 8}})
    assert (opts.draft_vocab, opts.lookup_max_match) == (0, 8)
    with pytest.raises(SelfAdmgConfigError, match=r"unknown self-admg option\(s\) \[.lookup_max_match.\]"):
        make_options({"lookup_max_match": 8})
    with pytest.raises(SelfAdmgConfigError, match="not experimental"):
        make_options({"experimental": {"attention_threshold": 0.9}})
    with pytest.raises(SelfAdmgConfigError, match="unknown experimental self-admg option"):
        make_options({"experimental": {"bogus": 1}})
    with pytest.raises(SelfAdmgConfigError, match=r"'draft_vocab' must be an integer in \[0, 1000000\]"):
        make_options({"experimental": {"draft_vocab": "all"}})


def test_options_round_trip_through_their_user_form():
    opts = make_options({"skip": "attention", "lookup": False, "experimental": {"skip_budget": 0.2}})
    assert make_options(opts.as_dict()) == opts


@pytest.mark.parametrize(
    "old, expected",
    [
        ({"skip_budget": 0.3}, {"skip_budget": 0.3}),
        ({"draft_vocab": 0}, {"draft_vocab": 0}),
        ({"lookup_ngram": 0}, {"lookup": False}),
        ({"lookup_ngram": 6}, {"lookup": True, "lookup_max_match": 6}),
    ],
)
def test_old_spellings_still_work_and_name_the_new_one(old, expected, caplog):
    options._deprecation_warned.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.selfspec"):
        opts = make_options(old)
    assert {name: getattr(opts, name) for name in expected} == expected
    (name,) = old
    assert any(f"{name!r} is deprecated" in r.message and "use" in r.message for r in caplog.records)
