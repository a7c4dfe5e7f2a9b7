"""The flags Lumen's agent launches an SGLang server with, parsed by SGLang 0.5.23's own command line
(`./dev sglang-test`, on CPU): they exist, take the values the agent gives, and set up the queue order
the gateway then reads back from `/server_info` (`ServerArgs.resolved_dict`, by field name)."""

from __future__ import annotations

import argparse

import msgspec
from sglang.srt.server_args import ServerArgs

from gateway.protocol.sglang import SGLangServerInfo, orders_by_priority
from worker_hooks.sglang.launcher import server_args

URL = "http://127.0.0.1:30000"


def parsed(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(server_args(URL, args))


def test_the_agents_launch_flags_parse_and_give_lumens_queue_order() -> None:
    ns = parsed(["--model-path", "m"])
    assert ns.sampling_backend == "pytorch" and ns.enable_deterministic_inference
    assert (ns.host, ns.port) == ("127.0.0.1", 30000)
    # what /server_info answers is the resolved arguments by field name: the same names decode
    fields = set(SGLangServerInfo.__struct_fields__)
    info = msgspec.convert({k: getattr(ns, k) for k in fields}, SGLangServerInfo)
    assert orders_by_priority(info)


def test_a_policy_the_operator_chose_is_kept_and_then_takes_no_priorities() -> None:
    ns = parsed(["--model-path", "m", "--schedule-policy", "lpm"])
    assert ns.schedule_policy == "lpm" and not ns.enable_priority_scheduling
    info = msgspec.convert({k: getattr(ns, k) for k in SGLangServerInfo.__struct_fields__}, SGLangServerInfo)
    assert not orders_by_priority(info)
