"""Spark fair pools per tenant and --spark-remote URLs (clients/worker/spark/pools.py,
spark_remote.py): the allocation file Spark reads and the URLs a task process gets."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from clients.worker.__main__ import build_parser, config_from_args
from clients.worker.spark.pools import allocation_xml, pool_name, spark_weight
from clients.worker.spark_remote_url import TOKEN_ENV, parse_remote, with_token


def test_pools_are_named_by_tenant_and_only_weights_other_than_one_are_declared() -> None:
    assert pool_name("acme") == "tenant-acme"
    assert pool_name("default") == "tenant-default"  # never Spark's default pool
    for bad in ("", "a b", 'x"/><pool name="y', "é", "a" * 65):
        assert pool_name(bad) is None
    assert [spark_weight(w) for w in (0.2, 1.0, 1.4, 2.6, 3.0, float("inf"))] == [1, 1, 1, 3, 3, 1]
    text = allocation_xml({"heavy": 3.0, "plain": 1.0, "tiny": 0.3, 'x"><evil': 5.0})
    pools = ET.fromstring(text).findall("pool")
    assert [(p.get("name"), p.findtext("weight"), p.findtext("schedulingMode")) for p in pools] == [
        ("tenant-heavy", "3", "FAIR")
    ]


def test_remote_urls_are_checked_and_the_session_is_steward_s() -> None:
    remote = parse_remote("sc://localhost:15099/;token=abc;use_ssl=false")
    assert remote.address == "sc://localhost:15099"
    assert remote.session_url("s1") == (
        "sc://localhost:15099/;token=abc;use_ssl=false;user_id=steward;session_id=s1"
    )
    assert parse_remote("sc://spark.example").port == 15002
    for bad, says in (
        ("http://host:1", "sc://HOST:PORT"),
        ("sc://host:notaport", "not a port"),
        ("sc://host:1/;session_id=x", "set by Steward"),
        ("sc://host:1/;token", "key=value"),
        ("sc://host:1/path", "after '/;'"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_remote(bad)
    assert with_token("sc://localhost:1", "t0k") == "sc://localhost:1/;token=t0k"
    with pytest.raises(ValueError, match="not both"):
        with_token("sc://localhost:1/;token=a", "b")


def test_the_worker_takes_the_remote_token_from_a_file_or_its_environment(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pathlib import Path

    token_file = Path(str(tmp_path)) / "token"
    token_file.write_text("s3cret\n")
    parser = build_parser()
    args = parser.parse_args(
        ["--spark-remote", "sc://localhost:1", "--spark-remote-token-file", str(token_file)]
    )
    assert config_from_args(args).spark_remote == "sc://localhost:1/;token=s3cret"
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    args = parser.parse_args(["--spark-remote", "sc://localhost:2"])
    assert config_from_args(args).spark_remote == "sc://localhost:2/;token=from-env"
    assert TOKEN_ENV not in __import__("os").environ  # no child inherits it
    with pytest.raises(ValueError, match="--spark connect"):
        config_from_args(parser.parse_args(["--spark-remote", "sc://h:1", "--spark", "off"]))
