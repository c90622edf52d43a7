"""File encodings of billing tables: CSV, JSON Lines and Parquet, from one typed column list.

Money never passes through a float: CSV and JSONL carry decimal text, Parquet carries
decimal128(38, 9) (1e-9 of the currency, the ledger's precision). Times are UTC: ISO 8601
text in CSV and JSONL, timestamp[ns, UTC] in Parquet.
"""
from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from enum import StrEnum

from costd.periods import iso


class Kind(StrEnum):
    TEXT = "text"
    INT = "int"
    DECIMAL = "decimal"
    TIME = "time"  # Unix ns
    JSON = "json"  # a dict: an object in JSONL, JSON text in CSV and Parquet


class ExportFormat(StrEnum):
    CSV = "csv"
    PARQUET = "parquet"
    JSONL = "jsonl"


CONTENT_TYPES = {ExportFormat.CSV: "text/csv", ExportFormat.JSONL: "application/jsonl",
                 ExportFormat.PARQUET: "application/vnd.apache.parquet"}
DECIMAL_PRECISION, DECIMAL_SCALE = 38, 9


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    kind: Kind


@dataclass(frozen=True, slots=True)
class Table:
    columns: tuple[Column, ...]
    rows: Sequence[tuple]


def _text(value: object, kind: Kind) -> str:
    if value is None:
        return ""
    if kind is Kind.DECIMAL:
        return format(value, "f")
    if kind is Kind.TIME:
        return iso(value)  # type: ignore[arg-type]
    if kind is Kind.JSON:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _json_value(value: object, kind: Kind) -> object:
    if value is None or kind in (Kind.INT, Kind.JSON, Kind.TEXT):
        return value
    return _text(value, kind)


def to_csv(table: Table) -> bytes:
    out = io.StringIO(newline="")
    writer = csv.writer(out, lineterminator="\r\n")  # RFC 4180
    writer.writerow([c.name for c in table.columns])
    for row in table.rows:
        writer.writerow([_text(v, c.kind) for v, c in zip(row, table.columns)])
    return out.getvalue().encode()


def to_jsonl(table: Table) -> bytes:
    lines = [json.dumps({c.name: _json_value(v, c.kind) for v, c in zip(row, table.columns)},
                        separators=(",", ":"))
             for row in table.rows]
    return "".join(line + "\n" for line in lines).encode()


def to_parquet(table: Table) -> bytes:
    import pyarrow as pa  # heavy: only when a Parquet file is asked for
    import pyarrow.parquet as pq
    types = {Kind.TEXT: pa.string(), Kind.INT: pa.int64(), Kind.JSON: pa.string(),
             Kind.DECIMAL: pa.decimal128(DECIMAL_PRECISION, DECIMAL_SCALE),
             Kind.TIME: pa.timestamp("ns", tz="UTC")}
    arrays = []
    for i, column in enumerate(table.columns):
        values = [row[i] for row in table.rows]
        if column.kind is Kind.JSON:
            values = [None if v is None else _text(v, Kind.JSON) for v in values]
        elif column.kind is Kind.DECIMAL:
            values = [None if v is None else Decimal(v).quantize(Decimal(1).scaleb(-9))
                      for v in values]
        arrays.append(pa.array(values, type=types[column.kind]))
    schema = pa.schema([pa.field(c.name, types[c.kind]) for c in table.columns])
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_arrays(arrays, schema=schema), sink)
    return sink.getvalue()


def encode(table: Table, fmt: ExportFormat) -> bytes:
    return {ExportFormat.CSV: to_csv, ExportFormat.JSONL: to_jsonl,
            ExportFormat.PARQUET: to_parquet}[fmt](table)
