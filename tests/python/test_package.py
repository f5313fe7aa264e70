"""refit as a Python package: what a worker given another's rank is told."""

import numpy as np
import pytest

import refit
from conftest import Background, Recorder, connect, transfer

TRAINER_ARGS = {"master_address": "127.0.0.1", "master_port": 0}


def model(seed=0):
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((16, 8), dtype=np.float32), "b": rng.standard_normal(8).astype(np.float16)}


def test_two_workers_given_one_init_info_are_told_how_to_get_their_own_ranks():
    sender = refit.Sender("tcp", timeout_ms=5000)
    engines = [refit.Engine("tcp", timeout_ms=5000, framework="numpy") for _ in range(2)]
    info = sender.prepare(dict(TRAINER_ARGS, world_size=3))
    accept = Background(sender.connect_workers)
    inits = [Background(e.init, info) for e in engines]  # the same rank_offset for both: a mistake
    errors = []
    for t in inits:
        try:
            t.join()
        except refit.Error as e:
            errors.append(e)
    sender.shutdown()  # rank 2 never comes: stop waiting for it
    with pytest.raises(refit.Error):
        accept.join()
    refused = [str(e) for e in errors if "already connected" in str(e)]
    assert len(refused) == 1, errors
    message = refused[0]
    assert "rank 1 is already connected" in message, message
    assert "rank_offset" in message and "1 + i" in message, message
    for e in engines:
        e.shutdown()


def test_workers_given_their_own_rank_offsets_all_connect():
    # The fix the message above names, as conftest.connect does it.
    src = model(3)
    with refit.Sender("tcp", timeout_ms=10000) as sender:
        engines = [refit.Engine("tcp", timeout_ms=10000, framework="numpy") for _ in range(2)]
        connect(sender, engines)
        rec = Recorder()
        transfer(sender, engines, src, rec)
        assert set(rec.got) == set(src)
        for e in engines:
            e.shutdown()
