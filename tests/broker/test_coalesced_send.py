"""Packets paho has queued go out in one send (`CoalescedSend`): over the shared Mosquitto, a
burst of publishes arrives whole and in order in far fewer sends than packets; and, on a real
socket pair whose buffer fills, a send the socket takes in part leaves every byte in order
(the credit owed to the packets behind the first is paid as paho writes them)."""

from __future__ import annotations

import asyncio
import collections
import secrets
import socket
from typing import Any

from broker.client import BrokerAddress, CoalescedSend, ConnectOptions, connect
from tests.broker.test_publish_at_once import SHARED_MOSQUITTO, _read_in_a_thread

BURST = 200


def test_a_burst_of_publishes_arrives_whole_in_order_in_few_sends() -> None:
    topic = f"specfleet-test/{secrets.token_hex(4)}/verdict"
    address = BrokerAddress.from_url(SHARED_MOSQUITTO)
    thread, subscribed, arrived = _read_in_a_thread(address, topic, BURST)
    assert subscribed.wait(10)
    payloads = [f"verdict {i} ".encode() * (1 + i % 40) for i in range(BURST)]

    async def writer() -> int:
        async with connect(address, ConnectOptions(client_id=f"w-{secrets.token_hex(4)}")) as bus:
            coalesced = bus._client._client._sock_send
            assert isinstance(coalesced, CoalescedSend)
            before = coalesced.sends
            # Every publish's first step in this one turn: the first goes at once, the rest
            # wait for the writer, together.
            await asyncio.gather(*(bus.publish(topic, payload) for payload in payloads))
            return int(coalesced.sends - before)

    sends = asyncio.run(writer())
    thread.join(10)
    assert [payload for _, payload in arrived] == payloads
    assert sends <= BURST // 10, f"{sends} sends for {BURST} publishes"


class _Paho:
    """What CoalescedSend reads of a paho client: its socket, its send and its queue."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock: Any = sock
        self._out_packet: collections.deque[dict[str, Any]] = collections.deque()

    def _sock_send(self, buf: bytes | bytearray) -> int:
        return int(self._sock.send(buf))


def _write_queue(paho: _Paho, send: CoalescedSend, asked: list[int]) -> bool:
    """paho's `_packet_write`, in miniature: the queue's packets in order, each as far as the
    socket takes it; False when the socket is full (the packet goes back to the front).
    `asked` counts the packets' writes."""
    while paho._out_packet:
        packet = paho._out_packet.popleft()
        try:
            asked[0] += 1
            written = send(packet["packet"][packet["pos"] :])
        except BlockingIOError:
            paho._out_packet.appendleft(packet)
            return False
        packet["pos"] += written
        if packet["pos"] < len(packet["packet"]):
            paho._out_packet.appendleft(packet)
    return True


def test_a_send_taken_in_part_leaves_every_byte_in_order() -> None:
    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    right.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    left.setblocking(False)
    paho = _Paho(left)
    send = CoalescedSend(paho)
    packets = [secrets.token_bytes(100 + (i * 37) % 900) for i in range(400)]
    for packet in packets:
        paho._out_packet.append({"packet": packet, "pos": 0})
    expected = b"".join(packets)
    received = bytearray()
    right.settimeout(5)
    asked = [0]
    while not _write_queue(paho, send, asked) or len(received) < len(expected):
        received += right.recv(65536)  # drain what the socket holds, then write on
    assert bytes(received) == expected
    # Fewer sends than packets, and writes answered from the credit in between.
    assert send.sends < len(packets) < asked[0]
    left.close()
    right.close()


def test_the_credit_belongs_to_its_socket() -> None:
    """A socket replaced while bytes were owed (a reconnect, whose queue paho rebuilds): the
    next packet is sent on the new socket, not answered from the old one's credit."""
    old, old_peer = socket.socketpair()
    paho = _Paho(old)
    send = CoalescedSend(paho)
    first, second = b"a" * 10, b"b" * 10
    paho._out_packet.append({"packet": second, "pos": 0})
    assert send(first) == len(first)  # both went out; 10 bytes owed to `second`
    new, new_peer = socket.socketpair()
    paho._sock = new
    paho._out_packet.clear()
    assert send(second) == len(second)
    assert new_peer.recv(100) == second
    assert old_peer.recv(100) == first + second
    for s in (old, old_peer, new, new_peer):
        s.close()
