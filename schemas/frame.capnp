# Frames of collective traffic between two ranks of a transport context (transport/tcp).
#
# On the wire a frame is
#
#   u32 little-endian length L | L bytes: a Cap'n Proto message (flat array) | payload bytes
#
# The first frame each way on a new connection carries a `Hello` and no payload; with a shared
# secret, the connecting side then sends one `Auth` frame. Every later frame carries a
# `FrameHeader` followed by exactly `payloadBytes` raw bytes (tensor bytes are never copied into a
# Cap'n Proto message). Readers bound L and `payloadBytes` before allocating, read
# headers with small traversal and nesting limits, and close the connection on anything malformed.
#
# Field numbers are never reused or renumbered: add fields at the end and bump `protocolVersion`
# only when an old reader would misread the new layout.

@0xe0d5d4d4b8f6e19e;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("consort::schemas");

# The version both ends of a connection must agree on (Hello.version, FrameHeader.version).
const protocolVersion :UInt16 = 1;

# The handshake: the connecting rank sends its Hello first, the accepting rank validates it and
# answers with its own; the pair is usable only when both have validated the other's. With a
# shared secret (transport/tcp/context.cpp, docs/multi_worker.md "Authentication"):
#
#   connector -> acceptor  Hello{rank c, ..., nonce Nc}
#   acceptor -> connector  Hello{rank a, ..., nonce Na, authProof HMAC(secret, "consort-mesh-v1|
#                          acceptor", group, epoch, size, c, a, Nc, Na)}
#   connector -> acceptor  Auth{proof HMAC(secret, "consort-mesh-v1|connector", same fields)}
#
# Without a secret both nonces and proofs are empty and there is no Auth frame.
struct Hello {
  version @0 :UInt16;
  # protocolVersion of the sender.

  rank @1 :UInt32;
  # The sender's rank in the group.

  size @2 :UInt32;
  # The number of ranks in the group, as the sender knows it.

  groupId @3 :UInt64;
  # Identifies the group (a job, or a collective group inside it): connections from another group
  # are refused.

  epoch @4 :UInt64;
  # The membership epoch the group was formed in: a rank of an older view is refused.

  nonce @5 :Data;
  # Fresh random bytes of the sender (32; 16 to 64 accepted), the challenge for the peer's proof.
  # Empty when the sender has no shared secret.

  authProof @6 :Data;
  # The acceptor's HMAC-SHA256 proof of the shared secret (see above); empty in the connector's
  # Hello, and without a secret.
}

# The connector's proof of the shared secret, the frame after the Hellos (only with a secret).
struct Auth {
  version @0 :UInt16;
  # protocolVersion of the sender.

  proof @1 :Data;
  # HMAC-SHA256 of the shared secret over "consort-mesh-v1|connector" and the fields of the
  # acceptor's proof; empty when `refusal` is set.

  refusal @2 :Text;
  # Why the connector sends no proof: the acceptor's own proof did not verify (so the connector
  # will not prove anything to it). For the acceptor's log; at most 256 bytes.
}

# The header of one message of a pair.
struct FrameHeader {
  version @0 :UInt16;
  # protocolVersion of the sender.

  senderRank @1 :UInt32;
  # The sender's rank; must be the rank the connection was established with.

  tag @2 :UInt64;
  # The message tag: a receive matches the oldest unmatched message with its tag.

  payloadBytes @3 :UInt64;
  # The number of raw payload bytes that follow the header.

  kind @4 :FrameKind;
  # What the frame is: a message (the default, so older writers' frames are data), or one of the
  # control frames that end a connection. A control frame's payload is at most 1024 bytes.
}

# The kinds of frames of a pair.
enum FrameKind {
  data @0;
  # A message: `tag` and the payload are the caller's.

  goodbye @1;
  # The sender leaves the group cleanly: every message it sent precedes this frame, it sends
  # nothing after it, and it half-closes the connection. The payload is the reason (UTF-8). The
  # receiver fails the receives that no message can match any more, and closes its side.

  abort @2;
  # The sender aborts the group: the payload is one byte (the consort::errc of the cause) then
  # the reason (UTF-8). The receiver fails every pending and later operation of the pair with that
  # code and reason, instead of a bare "the peer closed the connection".
}
