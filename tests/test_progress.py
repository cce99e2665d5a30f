"""utils/progress.py: the plain log lines a phase writes when no terminal is attached."""

import logging

from utils import progress


def test_a_phase_logs_its_start_its_rate_and_time_left_and_its_end(caplog, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.INFO):
        with progress.phase("tokenizing train", total=100, unit="pairs", log_every=5.0) as bar:
            now[0] = 10.0
            # 25 of 100 done in 10 s: 2.5/s, 75 left = 30 s
            bar.advance(25)
            now[0] = 12.0
            # under log_every since the last line: nothing written
            bar.advance(5)
            now[0] = 20.0
            bar.advance(20)
            now[0] = 40.0
    lines = [record.getMessage() for record in caplog.records]
    assert lines[0] == "tokenizing train: started (100 pairs)"
    assert lines[1] == "tokenizing train: 25/100 pairs (25%), 2.5 pairs/s, 0:00:30 left"
    assert lines[2] == "tokenizing train: 50/100 pairs (50%), 2.5 pairs/s, 0:00:20 left"
    assert lines[3] == "tokenizing train: done, 50 pairs in 0:00:40"


def test_track_yields_every_item_and_counts_them(caplog):
    with caplog.at_level(logging.INFO):
        assert list(progress.track(range(7), "decoding dev", unit="sentences")) == list(range(7))
    assert caplog.records[0].getMessage() == "decoding dev: started (7 sentences)"
    assert caplog.records[-1].getMessage().startswith("decoding dev: done, 7 sentences in ")


def test_a_disabled_phase_writes_nothing(caplog):
    with caplog.at_level(logging.INFO):
        with progress.phase("building", total=3, enabled=False) as bar:
            bar.advance(3)
    assert bar.done == 3 and not caplog.records
