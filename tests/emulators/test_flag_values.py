"""Each emulator's command line reaches what it starts: every flag, by its parameter's name."""

import argparse
from unittest import mock

import emulators.dev_server.cli as dev_cli
import emulators.sim.__main__ as sim_main
from emulators.flag_values import flag_values


def test_a_parameter_takes_its_flag_and_given_values_win():
    def target(a, b=2, *, c_d=3, **rest):
        pass

    args = argparse.Namespace(a=1, c_d=4, rest=9, other=5)
    assert flag_values(args, target) == {"a": 1, "c_d": 4}  # no flag for b; **rest is no parameter name
    assert flag_values(args, target, a=7) == {"a": 7, "c_d": 4}
    assert flag_values(argparse.Namespace(x_a=1, a=2), target, prefix="x_") == {"a": 1}


def test_the_dev_server_command_line_reaches_serve_and_the_draft(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    argv = [
        *("--model", str(tmp_path), "--port", "9", "--num-threads", "2", "--context-length", "64"),
        *("--max-batch-size", "3", "--model-name", "tiny", "--api-key", "k", "--admin-api-key", "a"),
        *("--disconnect-poll-s", "0.5", "--decode-log-interval", "7", "--log-level", "debug", "--trust-remote-code"),
        *("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/d"),
        *("--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"),
    ]
    with (
        mock.patch.object(dev_cli, "serve", autospec=True) as serve,
        mock.patch.object(dev_cli.Speculative, "from_flags", autospec=True, return_value="the draft") as draft,
    ):
        dev_cli.main(argv)
    assert draft.call_args.kwargs == {
        "draft_model_path": "/d", "algorithm": "EAGLE3", "num_steps": 2, "eagle_topk": 1, "num_draft_tokens": 3
    }  # fmt: skip
    assert serve.call_args.kwargs == {
        "model_dir": str(tmp_path), "host": "127.0.0.1", "port": 9, "log_level": "debug", "num_threads": 2,
        "context_length": 64, "max_batch_size": 3, "model_name": "tiny", "speculative": "the draft",
        "extraction": None, "api_key": "k", "admin_api_key": "a", "disconnect_poll_s": 0.5, "sglang_version": "0.5",
        "decode_log_interval": 7, "trust_remote_code": True,
    }  # fmt: skip


def test_the_sim_command_line_reaches_its_config_and_server():
    argv = ["--port", "9", "--starting", "--decode-ms", "5", "--prefill-ms", "2", "--eos-id", "3", "--vocab-size",
            "500", "--mean-len", "20", "--seed", "4", "--reserved-tokens", "6", "--api-key", "k"]  # fmt: skip
    with (
        mock.patch.object(sim_main, "SimServer", autospec=True) as server,
        mock.patch.object(sim_main.asyncio, "run", side_effect=lambda coro: coro.close()),
    ):
        sim_main.main(argv)
    kwargs = dict(server.call_args.kwargs)
    config = kwargs.pop("config")
    assert kwargs == {
        "host": "127.0.0.1", "port": 9, "starting": True, "log_level": "warning", "api_key": "k", "admin_api_key": None
    }  # fmt: skip
    assert (config.decode_s_per_token, config.prefill_s_per_token, config.eos_token_id) == (0.005, 0.002, 3)
    assert (config.vocab_size, config.mean_len, config.seed, config.reserved_tokens) == (500, 20.0, 4, 6)
