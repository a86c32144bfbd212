"""The dispatcher against a local receiver playing each service (tests/integration/notify_receiver.py):
success, HTTP 5xx, 429 with its hint, an error code inside HTTP 200, timeouts, a refused
connection — each ends delivered after retries or in the dead-letter file, as documented; rate
limits hold under a burst; a hanging sink blocks nothing; no secret reaches a log line or the
dead-letter file. A reply trickled a byte at a time is given up at the send's deadline, and a
hostile reply (a code of the wrong type, a wait of centuries) or a URL httpx refuses never ends
a sender: every alert ends delivered or dead-lettered with the reason."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from tests.integration.notify_receiver import Answer, receiver
from tunerd.notify.alert import Alert, fingerprint
from tunerd.notify.dispatch import DEAD_LETTER, Dispatcher
from tunerd.notify.sink import Rate, Target
from tunerd.notify.sinks import KINDS

pytestmark = pytest.mark.slow
SECRET = "SECtest-secret-0123456789abcdef"


def alert(number: int = 0, severity: str = "warning", **changes: Any) -> Alert:
    fields: dict[str, Any] = {
        "severity": severity,
        "status": "firing",
        "title": f"kv-pool-saturated #{number}",
        "summary": "KV pool 97 % used",
        "engine": "main",
        "host": "box",
        "time": time.time(),
        "policy": "kv-pool-saturated",
        "fingerprint": fingerprint("main", "kv-pool-saturated", str(number)),
        **changes,
    }
    return Alert(**fields)


class Run:
    """A dispatcher with one sink, what it said, and its dead-letter file."""

    def __init__(self, tmp_path: Path, target: Target, **options: Any) -> None:
        self.said: list[dict[str, Any]] = []
        options = {"backoff_base": 0.05, "backoff_max": 0.2, "timeout": 2.0, **options}
        self.dispatcher = Dispatcher(
            [target],
            tmp_path,
            say=lambda event, **fields: self.said.append({"event": event, **fields}),
            **options,
        ).start()
        self.dead_letter = tmp_path / DEAD_LETTER

    def dead(self) -> list[dict[str, Any]]:
        if not self.dead_letter.exists():
            return []
        return [json.loads(line) for line in self.dead_letter.read_text().splitlines()]

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.said if e["event"] == name]


@pytest.mark.parametrize("kind", KINDS)
def test_each_service_takes_a_message(tmp_path: Path, kind: str) -> None:
    with receiver(kind) as service:
        run = Run(
            tmp_path,
            Target("ops", kind, service.url, SECRET if kind in ("feishu", "dingtalk", "webhook") else None),
        )
        run.dispatcher.submit(alert())
        [got] = service.wait_for(1)
        run.dispatcher.close()
    assert run.events("notify_sent")[0]["alerts"] == 1
    assert run.dead() == []
    body = got.json()
    if kind == "feishu":  # checked as Feishu checks it
        key = f"{body['timestamp']}\n{SECRET}".encode()
        assert body["sign"] == base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()
    if kind == "dingtalk":
        timestamp = got.query["timestamp"][0]
        digest = hmac.new(SECRET.encode(), f"{timestamp}\n{SECRET}".encode(), hashlib.sha256).digest()
        assert got.query["sign"][0] == base64.b64encode(digest).decode()  # parse_qs undid the quoting
        assert abs(int(timestamp) / 1000 - time.time()) < 60
    if kind == "alertmanager":
        assert got.path.endswith("/api/v2/alerts")
    if kind == "webhook":
        signed = got.headers["X-Tunerd-Timestamp"].encode() + b"." + got.body
        assert (
            got.headers["X-Tunerd-Signature"]
            == "sha256=" + hmac.new(SECRET.encode(), signed, hashlib.sha256).hexdigest()
        )


def test_5xx_is_retried_until_delivered(tmp_path: Path) -> None:
    with receiver("slack") as service:
        service.answer(Answer(500, b"rollup_error"), Answer(503, b""))
        run = Run(tmp_path, Target("ops", "slack", service.url))
        run.dispatcher.submit(alert())
        got = service.wait_for(3)
        run.dispatcher.close()
    assert len(got) == 3
    assert [e["attempt"] for e in run.events("notify_retry")] == [1, 2]
    assert "HTTP 500 rollup_error" in run.events("notify_retry")[0]["reason"]
    assert run.events("notify_sent")[0]["attempt"] == 3
    assert run.dead() == []


def test_429_waits_as_long_as_the_service_asked(tmp_path: Path) -> None:
    with receiver("discord") as service:
        hint = b'{"message":"You are being rate limited.","retry_after":1.2,"global":false}'
        service.answer(Answer(429, hint, {"Retry-After": "1"}))
        run = Run(tmp_path, Target("ops", "discord", service.url))
        run.dispatcher.submit(alert())
        got = service.wait_for(2)
        run.dispatcher.close()
    assert len(got) == 2
    assert got[1].at - got[0].at >= 1.2  # the larger of the two hints
    assert run.events("notify_retry")[0]["wait"] >= 1.2


def test_an_error_code_inside_http_200(tmp_path: Path) -> None:
    """Feishu's rate-limit code is tried again; DingTalk's security failure is refused for good."""
    with receiver("feishu") as feishu:
        feishu.answer(Answer(200, b'{"code":11232,"msg":"frequency limited"}'))
        run = Run(tmp_path / "feishu", Target("fs", "feishu", feishu.url))
        run.dispatcher.submit(alert())
        assert len(feishu.wait_for(2)) == 2
        run.dispatcher.close()
    assert run.events("notify_sent")
    assert run.dead() == []
    with receiver("dingtalk") as dingtalk:
        dingtalk.answer(Answer(200, b'{"errcode":310000,"errmsg":"keywords not in content"}'))
        run = Run(tmp_path / "ding", Target("dt", "dingtalk", dingtalk.url))
        run.dispatcher.submit(alert())
        deadline = time.monotonic() + 5
        while not run.dead() and time.monotonic() < deadline:
            time.sleep(0.02)
        run.dispatcher.close()
        assert len(dingtalk.got) == 1  # not tried again
    [dead] = run.dead()
    assert dead["reason"] == "errcode 310000: keywords not in content"
    assert (dead["sink"], dead["kind"], dead["attempts"]) == ("dt", "dingtalk", 1)
    assert dead["alerts"][0]["title"] == "kv-pool-saturated #0"


def test_a_timeout_is_retried(tmp_path: Path) -> None:
    with receiver("wecom") as service:
        service.answer(Answer(200, b'{"errcode":0}', delay=3.0))
        run = Run(tmp_path, Target("ops", "wecom", service.url), timeout=0.5)
        run.dispatcher.submit(alert())
        assert len(service.wait_for(2)) == 2
        deadline = time.monotonic() + 5
        while not run.events("notify_sent") and time.monotonic() < deadline:
            time.sleep(0.02)
        run.dispatcher.close()
    assert run.events("notify_retry")[0]["reason"] == "no complete answer within 0.5 s"
    assert run.events("notify_sent")


def test_a_refused_connection_ends_in_the_dead_letter_file_after_the_last_try(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = Run(tmp_path, Target("ops", "webhook", f"http://127.0.0.1:{port}/hook"), max_attempts=3)
    run.dispatcher.submit(alert(count=4))
    deadline = time.monotonic() + 10
    while not run.dead() and time.monotonic() < deadline:
        time.sleep(0.02)
    run.dispatcher.close()
    [dead] = run.dead()
    assert dead["attempts"] == 3
    assert dead["reason"].startswith("gave up after 3 tries: ConnectError")
    assert dead["alerts"][0]["count"] == 4
    assert run.dispatcher.deliveries()["ops"].dead_alerts == 4


def test_a_burst_of_100_keeps_dingtalks_limit_and_loses_nothing(tmp_path: Path) -> None:
    """20 a minute: 100 alerts within ~2 s make at most 20 messages in that minute; what waits
    goes out as digests when the limit frees (here: a scaled limit, 20 per 3 s) — every alert
    counted once."""
    with receiver("dingtalk") as service:
        run = Run(tmp_path / "real", Target("dt", "dingtalk", service.url))
        for number in range(100):
            run.dispatcher.submit(alert(number))
            time.sleep(0.02)
        time.sleep(1.0)
        in_the_minute = len(service.got)
        run.dispatcher.close()  # what the limit still holds goes to the dead-letter file
    assert 1 <= in_the_minute <= 20
    sent = run.dispatcher.deliveries()["dt"].sent_alerts
    dead = sum(alert["count"] for record in run.dead() for alert in record["alerts"])
    assert sent + dead == 100, (sent, dead)
    assert dead > 0
    assert {record["reason"] for record in run.dead()} == {"tunerd stopped before it could be sent"}

    with receiver("dingtalk") as service:
        run = Run(tmp_path / "scaled", Target("dt", "dingtalk", service.url), rates={"dt": Rate(20, 3.0)})
        for number in range(100):
            run.dispatcher.submit(alert(number))
            time.sleep(0.01)
        deadline = time.monotonic() + 15
        while run.dispatcher.deliveries()["dt"].sent_alerts < 100 and time.monotonic() < deadline:
            time.sleep(0.05)
        run.dispatcher.close()
        got = list(service.got)
    assert run.dispatcher.deliveries()["dt"].sent_alerts == 100
    assert run.dead() == []
    # the limit held: at most 20 in any 3 s, as the dispatcher counts (when a send starts). The
    # receiver sees arrivals, each late by its own delivery time, so two sends 3.0 s apart may
    # arrive a little less apart: 0.3 s of slack (a clean-clone run saw 21 within 3.0 s).
    arrivals = [g.at for g in got]
    assert max(sum(1 for at in arrivals if start <= at < start + 2.7) for start in arrivals) <= 20
    digests = [g.json()["markdown"]["title"] for g in got if "held back" in g.json()["markdown"]["title"]]
    assert digests  # the rest were grouped into digests, not dropped


def test_the_same_condition_repeating_becomes_one_message_with_a_count(tmp_path: Path) -> None:
    with receiver("slack") as service:
        run = Run(tmp_path, Target("ops", "slack", service.url), group_window=1.0)
        run.dispatcher.submit(alert(7))
        service.wait_for(1)
        for _ in range(5):
            run.dispatcher.submit(alert(7))  # within the window: held, counted
        time.sleep(0.3)
        assert len(service.got) == 1
        got = service.wait_for(2, timeout=5)
        run.dispatcher.close()
    assert len(got) == 2
    assert "(repeated 5 times)" in got[1].json()["text"]


def test_a_hanging_sink_blocks_neither_submit_nor_the_other_sinks(tmp_path: Path) -> None:
    with receiver("webhook") as hanging, receiver("slack") as healthy:
        hanging.answer(Answer(200, b"{}", delay=30.0))
        dispatcher = Dispatcher(
            [Target("stuck", "webhook", hanging.url), Target("ok", "slack", healthy.url)],
            tmp_path,
            timeout=40,
        ).start()
        dispatcher.submit(alert(1))
        hanging.wait_for(1)
        started = time.monotonic()
        for number in range(2, 50):
            dispatcher.submit(alert(number))
        took = time.monotonic() - started
        assert took < 0.1  # 48 submits while a sink hangs
        assert healthy.wait_for(2, timeout=5)  # the other sink goes on
        hanging.release.set()
        dispatcher.close()


def test_no_secret_reaches_a_log_line_or_the_dead_letter_file(tmp_path: Path) -> None:
    with receiver("feishu") as service:
        url = service.url + "?token=tok-987654321"
        echoed = json.dumps({"code": 19021, "msg": f"sign match fail for {url} with {SECRET}"}).encode()
        service.answer(Answer(200, echoed))
        run = Run(tmp_path, Target("fs", "feishu", url, SECRET))
        run.dispatcher.submit(alert())
        deadline = time.monotonic() + 5
        while not run.dead() and time.monotonic() < deadline:
            time.sleep(0.02)
        run.dispatcher.close()
    text = run.dead_letter.read_text() + json.dumps(run.said)
    for secret in (SECRET, "secret-token-path", "tok-987654321", url):
        assert secret not in text
        assert unquote(secret) not in text
    assert "[redacted]" in run.dead()[0]["reason"]


def test_stopping_while_a_send_hangs_keeps_the_alert_in_the_dead_letter_file(tmp_path: Path) -> None:
    with receiver("webhook") as hanging:
        hanging.answer(Answer(200, b"{}", delay=30.0))
        run = Run(tmp_path, Target("stuck", "webhook", hanging.url), timeout=40)
        run.dispatcher.submit(alert(3))
        hanging.wait_for(1)
        started = time.monotonic()
        run.dispatcher.close(timeout=0.5)
        assert time.monotonic() - started < 2
        hanging.release.set()
    [dead] = run.dead()
    assert dead["reason"] == "tunerd stopped while sending (it may have arrived)"
    assert dead["alerts"][0]["title"] == "kv-pool-saturated #3"


def test_a_flood_beyond_what_may_wait_goes_to_the_dead_letter_file_at_once(tmp_path: Path) -> None:
    with receiver("wecom") as service:
        run = Run(tmp_path, Target("wc", "wecom", service.url), max_waiting=10, rates={"wc": Rate(1, 60.0)})
        for number in range(30):
            run.dispatcher.submit(alert(number))
        flooded = [
            record for record in run.dead() if record["reason"].startswith("more than 10 alerts waiting")
        ]
        run.dispatcher.close(timeout=0.5)
    # the first message took what was waiting when it went (1 to 10), 10 more waited: the rest here
    assert 10 <= len(flooded) <= 19
    delivered = run.dispatcher.deliveries()["wc"].sent_alerts
    dead = sum(a["count"] for record in run.dead() for a in record["alerts"])
    assert delivered + dead == 30


def test_alertmanager_gets_a_firing_alert_again_until_it_resolves(tmp_path: Path) -> None:
    with receiver("alertmanager") as am:
        run = Run(tmp_path, Target("am", "alertmanager", am.url), resend=0.4)
        firing = alert(5)
        run.dispatcher.submit(firing)
        assert len(am.wait_for(3, timeout=5)) >= 3  # the first, then again every 0.4 s
        run.dispatcher.submit(firing.resolved(time.time(), "cleared"))
        time.sleep(0.3)
        settled = len(am.got)
        time.sleep(1.0)
        got = list(am.got)
        run.dispatcher.close()
    assert len(got) == settled  # resolved: no more re-sends
    posted = [g.json()[0] for g in got]
    assert all(p["labels"]["alertname"] == "kv-pool-saturated" for p in posted)
    assert {p["startsAt"] for p in posted} == {posted[0]["startsAt"]}  # one alert, sent again
    assert all(p["endsAt"] > p["startsAt"] for p in posted[:-1])  # firing: held ahead
    assert posted[-1]["endsAt"] < posted[-2]["endsAt"]  # resolved: ended now


def wait_until(check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (result := check()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return result


@pytest.mark.parametrize("slow", [Answer(200, b'{"ok":true}' * 20, drip=0.5), Answer(200, b"{}", stall=30.0)])
def test_a_receiver_that_trickles_its_reply_is_given_up_at_the_deadline_and_later_alerts_flow(
    tmp_path: Path, slow: Answer
) -> None:
    """A reply of 220 bytes at one byte per 0.5 s satisfied every per-read timeout for almost
    two minutes and held the sender; the send's deadline (2 s here) ends it, the message is
    tried again, and the alerts after it go out."""
    with receiver("webhook") as service:
        service.answer(slow)
        run = Run(tmp_path, Target("ops", "webhook", service.url), timeout=2.0)
        started = time.monotonic()
        run.dispatcher.submit(alert(1))
        assert wait_until(lambda: run.events("notify_sent"), timeout=10)
        took = time.monotonic() - started
        run.dispatcher.submit(alert(2))
        assert wait_until(lambda: len(run.events("notify_sent")) == 2, timeout=10)
        run.dispatcher.close()
    assert took < 8, took  # the deadline and a backoff, not the trickle's two minutes
    [retry] = run.events("notify_retry")
    assert retry["reason"] == "no complete answer within 2 s"
    assert [g.json()["alerts"][0]["title"] for g in service.got] == [
        "kv-pool-saturated #1",
        "kv-pool-saturated #1",
        "kv-pool-saturated #2",
    ]
    assert run.dead() == []


def test_a_reply_code_of_the_wrong_type_is_an_unknown_reply_not_a_dead_sender(tmp_path: Path) -> None:
    """``{"errcode":[1]}`` raised TypeError (unhashable list) in the sender's thread: the alert
    vanished and every later one waited until tunerd stopped."""
    with receiver("dingtalk") as service:
        service.answer(Answer(200, b'{"errcode":[1],"errmsg":{"a":1e999}}'))
        run = Run(tmp_path, Target("dt", "dingtalk", service.url))
        run.dispatcher.submit(alert(1))
        assert wait_until(lambda: run.events("notify_sent"))
        run.dispatcher.submit(alert(2))
        assert wait_until(lambda: len(run.events("notify_sent")) == 2)
        run.dispatcher.close()
    assert run.events("notify_retry")[0]["reason"].startswith("HTTP 200 with an unknown reply")
    assert run.dead() == []


@pytest.mark.parametrize(
    ("kind", "hint"),
    [
        ("slack", Answer(429, b"rate_limited", {"Retry-After": "99999999999"})),
        ("discord", Answer(429, b'{"message":"slow down","retry_after":1e300}')),
    ],
)
def test_a_wait_of_centuries_is_clamped_to_an_hour_and_the_alert_is_kept(
    tmp_path: Path, kind: str, hint: Answer
) -> None:
    """``Retry-After: 99999999999`` and Discord's ``retry_after: 1e300`` raised OverflowError in
    the lane's wait: the thread died with the alert. Clamped to an hour, the lane waits; at stop
    the alert and the one behind it are in the dead-letter file with why."""
    with receiver(kind) as service:
        service.answer(hint)
        run = Run(tmp_path, Target("ops", kind, service.url))
        run.dispatcher.submit(alert(1))
        assert wait_until(lambda: run.events("notify_retry"))
        run.dispatcher.submit(alert(2))
        time.sleep(0.2)
        assert run.dispatcher.lanes["ops"].thread.is_alive()  # type: ignore[union-attr]
        run.dispatcher.close(timeout=1.0)
    [retry] = run.events("notify_retry")
    assert 3600 * 0.99 <= retry["wait"] <= 3600 * 1.2  # the service's wish, at most an hour
    titles = {a["title"]: record["reason"] for record in run.dead() for a in record["alerts"]}
    assert titles["kv-pool-saturated #1"].startswith("tunerd stopped; last try: HTTP")
    assert titles["kv-pool-saturated #2"] == "tunerd stopped before it could be sent"
    assert len(service.got) == 1


def test_a_wait_that_is_not_a_number_is_no_wait(tmp_path: Path) -> None:
    with receiver("webhook") as service:
        service.answer(Answer(503, b"", {"Retry-After": "NaN"}), Answer(429, b"", {"Retry-After": "-5"}))
        run = Run(tmp_path, Target("ops", "webhook", service.url))
        run.dispatcher.submit(alert(1))
        assert wait_until(lambda: run.events("notify_sent"))
        run.dispatcher.close()
    assert [retry["wait"] < 1 for retry in run.events("notify_retry")] == [True, True]  # the backoff


def test_a_url_httpx_refuses_dead_letters_each_alert_with_why_and_the_sender_goes_on(tmp_path: Path) -> None:
    """``httpx.InvalidURL`` is no ``httpx.HTTPError``: it ended the sender's thread."""
    run = Run(tmp_path, Target("bad", "webhook", "http://[::1/hook-token-123456"))
    run.dispatcher.submit(alert(1))
    assert wait_until(lambda: len(run.dead()) == 1)
    run.dispatcher.submit(alert(2))
    assert wait_until(lambda: len(run.dead()) == 2)  # the sender is alive: not at stop
    run.dispatcher.close()
    reasons = [record["reason"] for record in run.dead()]
    assert all(reason.startswith("the URL cannot be used: InvalidURL") for reason in reasons), reasons
    assert [record["attempts"] for record in run.dead()] == [1, 1]
    assert "hook-token-123456" not in run.dead_letter.read_text()
