"""llama.cpp as chapter 13's peer: found where `make peers-llama` built it, a clear one-line
error where it did not, its benchmark's rows read back; run for real only where it is built."""

from __future__ import annotations

import socket

import pytest
import torch

from miniinfer.bench.peers import PEERS_VENV_ENV, PeerMissingError, llama_cpp

ROW = ('{"n_kv_max": 1024, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
       '"n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 64, "tg": 32, "pl": 8, '
       '"n_kv": 768, "t_pp": 1.5, "speed_pp": 341.3, "t_tg": 2.0, "speed_tg": 128.0, "t": 3.5, '
       '"speed": 219.4}')


def built() -> bool:
    try:
        llama_cpp.find_llama_cpp()
    except PeerMissingError:
        return False
    return True


def test_a_missing_build_says_how_to_make_it(tmp_path, monkeypatch):
    monkeypatch.setenv(PEERS_VENV_ENV, str(tmp_path))
    with pytest.raises(PeerMissingError, match="make peers-llama") as missing:
        llama_cpp.find_llama_cpp()
    assert "llama-batched-bench" in str(missing.value) and "\n" not in str(missing.value)


def test_chapter_13_records_our_rows_only_without_it(tmp_path, monkeypatch, capsys):
    from miniinfer.lab.quantization import record_llama_cpp

    monkeypatch.setenv(PEERS_VENV_ENV, str(tmp_path))
    assert record_llama_cpp(torch.device("cpu")) == []
    assert "records our rows only" in capsys.readouterr().out


def test_its_jsonl_rows_are_read_and_the_log_lines_skipped():
    rows = llama_cpp.parse_jsonl(f"main: n_kv_max = 1024\n{ROW}\n\nllama_perf: done\n")
    assert [(r["pl"], r["speed_tg"], r["speed_pp"]) for r in rows] == [(8, 128.0, 341.3)]


def test_the_shipped_file_is_q4_1_and_the_others_are_made_from_it(tmp_path):
    shipped = tmp_path / "model.Q4_1.gguf"
    assert llama_cpp.gguf_file("int4", shipped, tmp_path / "cache") == shipped
    made = tmp_path / "cache" / "model.Q4_1.Q8_0.gguf"
    made.parent.mkdir()
    made.write_bytes(b"GGUF")  # made once: a second call reuses it without the quantizer
    assert llama_cpp.gguf_file("int8", shipped, tmp_path / "cache") == made


@pytest.mark.skipif(not built(), reason="llama.cpp is not built here (make peers-llama)")
def test_llama_cpp_decodes_the_shipped_q4_1_file():
    from miniinfer.core.models import smollm2_gguf

    (row,) = llama_cpp.batched_bench(smollm2_gguf(), (2,), prompt_len=8, new_tokens=4,
                                     threads=1, repeats=1)
    assert row["batch_size"] == 2 and row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0
    assert row["decode_tok_s_min"] == row["decode_tok_s_max"] == row["decode_tok_s"]


def test_llama_server_missing_says_how_to_build_it(tmp_path, monkeypatch):
    from miniinfer.bench.peers.llama_server import find_llama_server

    monkeypatch.setenv(PEERS_VENV_ENV, str(tmp_path))
    with pytest.raises(PeerMissingError, match="make peers-llama") as missing:
        find_llama_server()
    assert "llama-server" in str(missing.value) and "\n" not in str(missing.value)


def test_llama_server_serves_chapter_10s_client_the_tokens_asked(smollm2):
    """Chapter 15's peer, over HTTP with our client: every request gets exactly its tokens."""
    from miniinfer.bench.peers.llama_server import find_llama_server, start_llama_server
    from miniinfer.bench.serving import WorkloadConfig, make_workload
    from miniinfer.bench.serving.http import serve_http
    from miniinfer.core.models import smollm2_gguf

    try:
        find_llama_server()
    except PeerMissingError as missing:
        pytest.skip(str(missing))
    workload = make_workload(smollm2, WorkloadConfig(num_requests=3, prompt_len=(8, 40),
                                                     output_len=(5, 12), seed=1))
    with socket.socket() as probe:  # a port free now, so no other run's server is in the way
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with start_llama_server(smollm2_gguf(), smollm2.name, parallel=2, port=port,
                            context_per_slot=256) as server:
        run = serve_http(server.base_url, smollm2.name, workload, max_concurrency=2)
    assert [len(r.output_ids) for r in run.requests] == [w.max_new_tokens for w in workload]
    assert server.process.poll() is not None, "stopped when the block ended"
