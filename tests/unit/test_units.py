"""Sizes and durations: parsed and printed in one place, errors quoting the bad text."""

from __future__ import annotations

import pytest

from tunerd.units import (
    GIB,
    MIB,
    UnitError,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
    parse_token_count,
)


class TestParseSize:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("24GiB", 24 * GIB),
            ("512MiB", 512 * MIB),
            ("1.5 GiB", 3 * GIB // 2),
            ("8GB", 8_000_000_000),
            ("100kB", 100_000),
            ("4Gi", 4 * GIB),
            ("4096", 4096),
            ("4096B", 4096),
            ("0", 0),
        ],
    )
    def test_parse_size_units_bytes(self, text: str, expected: int) -> None:
        """Binary, decimal and Kubernetes-style units all become bytes."""
        assert parse_size(text) == expected

    def test_parse_size_int_passes_through(self) -> None:
        assert parse_size(1024) == 1024

    @pytest.mark.parametrize(
        ("text", "fragment"),
        [
            ("24XB", "unknown unit 'XB'"),
            ("GiB", "expected a number and a unit"),
            ("-1GiB", "cannot be negative"),
            ("", "expected a number"),
            ("1,5GiB", "expected a number"),
        ],
    )
    def test_parse_size_bad_text_quoted_in_error(self, text: str, fragment: str) -> None:
        """The error names the text the user typed and what is wrong with it."""
        with pytest.raises(UnitError) as caught:
            parse_size(text)
        assert f"'{text}'" in str(caught.value)
        assert fragment in str(caught.value)


class TestFormatSize:
    @pytest.mark.parametrize(
        ("value", "expected"),
        [
            (16 * GIB, "16.00 GiB"),
            (512 * MIB, "512.00 MiB"),
            (131072, "128.00 KiB"),
            (12, "12 B"),
            (-(2 * GIB), "-2.00 GiB"),
        ],
    )
    def test_format_size_largest_unit(self, value: int, expected: str) -> None:
        assert format_size(value) == expected

    def test_format_size_round_trips_through_parse(self) -> None:
        assert parse_size(format_size(24 * GIB).replace(" ", "")) == 24 * GIB


class TestDurations:
    @pytest.mark.parametrize(
        ("text", "seconds"),
        [
            ("500ms", 0.5),
            ("5s", 5.0),
            ("10m", 600.0),
            ("1h", 3600.0),
            ("1h30m", 5400.0),
            ("2m30s", 150.0),
            ("1d", 86400.0),
            ("1.5h", 5400.0),
            ("30", 30.0),
        ],
    )
    def test_parse_duration_seconds(self, text: str, seconds: float) -> None:
        assert parse_duration(text) == pytest.approx(seconds)

    @pytest.mark.parametrize("text", ["banana", "10x", "5s10m", "1h1h", "", "-5s", "m"])
    def test_parse_duration_bad_text_quoted(self, text: str) -> None:
        with pytest.raises(UnitError) as caught:
            parse_duration(text)
        assert f"'{text}'" in str(caught.value)

    @pytest.mark.parametrize(
        ("seconds", "text"),
        [(0.5, "500ms"), (5, "5s"), (600, "10m"), (5400, "1h30m"), (90061, "1d1h1m1s"), (0, "0s")],
    )
    def test_format_duration_inverse_of_parse(self, seconds: float, text: str) -> None:
        assert format_duration(seconds) == text
        assert parse_duration(text) == pytest.approx(seconds)


class TestTokenCounts:
    @pytest.mark.parametrize(
        ("text", "tokens"),
        [("32768", 32768), ("32K", 32768), ("32k", 32000), ("25.6k", 25600), ("1M", 1048576)],
    )
    def test_parse_token_count_like_vllm(self, text: str, tokens: int) -> None:
        """vLLM's --max-model-len convention: lowercase decimal, uppercase binary."""
        assert parse_token_count(text) == tokens

    @pytest.mark.parametrize("text", ["0", "-4", "1.5", "lots", "32KB"])
    def test_parse_token_count_bad_text(self, text: str) -> None:
        with pytest.raises(UnitError) as caught:
            parse_token_count(text)
        assert f"'{text}'" in str(caught.value)
