# Membership messages of a consort cluster (docs/multi_worker.md): workers join at the chief, the chief
# answers with the view, members exchange heartbeats, leave cleanly, and abort the group when a
# member is lost. Every message on a membership connection is one `MembershipMessage`, framed like
# collective traffic (see frame.capnp): a u32 little-endian length, then the Cap'n Proto message.
# Readers bound that length and every list before allocating.
#
# Field numbers are never reused or renumbered: add fields at the end.

@0xced3607124bc9856;

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("consort::schemas");

# The membership protocol version a worker speaks (Join.protocolVersion).
const membershipVersion :UInt16 = 1;

# A task of the cluster spec, as TF_CONFIG names it: ("worker", 1), ("chief", 0).
struct Task {
  type @0 :Text;
  index @1 :UInt32;
}

# One device of a worker, as consort names it ("CPU:0", "GPU:1").
struct Device {
  name @0 :Text;

  kind @1 :Kind;
  enum Kind {
    cpu @0;
    gpu @1;
  }

  memoryBytes @2 :UInt64;
  # The device's memory, 0 when unknown.
}

# A worker asks the chief to admit it.
struct Join {
  task @0 :Task;

  address @1 :Text;
  # "host:port" where this worker listens for collective traffic.

  devices @2 :List(Device);
  # The worker's local devices, in local replica order.

  protocolVersion @3 :UInt16;
  # membershipVersion of the worker; the chief refuses another version.

  nonce @4 :Data;
  # Fresh random bytes of the worker, the challenge for the chief's proof (View.authProof).

  authProof @5 :Data;
  # HMAC-SHA256 of the cluster's shared secret over the label "consort-membership-v1|join", the
  # chief's nonce (Challenge.nonce), this Join's nonce, the task type and index, and the address
  # (transport/membership/service.cpp `join_proof`); empty when the worker has no secret.

  pid @6 :UInt32;
  # The worker's process id, for logs.

  clusterDigest @7 :UInt64;
  # A hash of the cluster this worker was given (TF_CONFIG or its cluster resolver): every task of
  # every job but the evaluator, with its address, in sorted order (transport/membership/
  # cluster_check.hpp). Never 0 (0: an older Join without one). The chief refuses a Join whose
  # digest differs from its own cluster's.

  cluster @8 :Text;
  # That cluster as text, "[worker:0=host:port, worker:1=host:port]", cut at an entry when it
  # would not fit the frame (it then ends ", ...]"): for the chief's refusal to name both lists.

  standbyAddress @9 :Text;
  # Elastic groups: "host:port" where this worker would lead the group's re-formations if the chief
  # were lost and it were the first member after it (its successor); empty otherwise.

  sentNs @10 :Int64;
  # The worker's wall clock when it sent this Join (ns since the Unix epoch; 0: not given). The
  # chief echoes it in its View, so that the worker learns the chief's clock with its view.
}

# The chief refuses a Join (wrong version, failed proof, another cluster, a task it does not
# expect, a duplicate).
struct Refusal {
  task @0 :Task;
  reason @1 :Text;
}

# One member of a view.
struct Member {
  rank @0 :UInt32;
  # The member's rank in the group: its worker id (the chief is 0).

  task @1 :Task;

  address @2 :Text;
  # "host:port" of its collective traffic.

  devices @3 :List(Device);

  standbyAddress @4 :Text;
  # Its Join's standbyAddress: where it leads the group if it succeeds a lost chief.

  pid @5 :UInt32;
  # Its process id (its Join's pid; the chief's own): a member on the same host that falls silent
  # while its process is runnable is waiting for a CPU, not hung (0: not known).
}

# The cluster as the chief sees it, sent to every member when all have joined and again whenever
# it changes; a later epoch replaces an earlier one.
struct View {
  epoch @0 :UInt64;
  # Increases with every change of membership.

  groupId @1 :UInt64;
  # Identifies the group of this epoch in transport handshakes (frame.capnp Hello.groupId).

  members @2 :List(Member);
  # Every member, in rank order.

  ncclUniqueId @3 :Data;
  # The NCCL unique id of this epoch's communicator (128 opaque bytes), empty without GPUs.

  nonce @4 :Data;
  # The chief's challenge for later proofs (reserved).

  authProof @5 :Data;
  # HMAC-SHA256 of the cluster's shared secret over the label "consort-membership-v1|view", the
  # nonces of the receiving worker's connection (Challenge.nonce, Join.nonce), its task, the epoch
  # and the group id (service.cpp `view_proof`): the chief proves it knows the secret too. Empty
  # without a secret.

  sentNs @6 :Int64;
  joinSentNs @7 :Int64;
  joinReceivedNs @8 :Int64;
  # The chief's wall clock when it sent this View, and the receiving worker's Join: its sentNs and
  # when the chief received it (0: none). As a Heartbeat's echo: one NTP-style round trip, whose
  # delay leaves out the time the chief held the Join (the rendezvous).
}

# A member's liveness signal, sent periodically to the chief (and by the chief to members).
struct Heartbeat {
  epoch @0 :UInt64;
  rank @1 :UInt32;
  sequence @2 :UInt64;
  # Increases by one with every heartbeat of this member.

  sentNs @3 :Int64;
  # The sender's wall clock when it sent this (ns since the Unix epoch).

  echoSentNs @4 :Int64;
  echoReceivedNs @5 :Int64;
  # The sentNs of the last heartbeat the sender received from the recipient, and when it received
  # it on its own clock (0: none yet). With sentNs and its own receive time, the recipient has one
  # NTP-style round trip: its clock's offset from the sender's, and the trip's delay.
}

# A member leaves the cluster cleanly (shutdown); it is not reported as lost.
struct Leave {
  epoch @0 :UInt64;
  rank @1 :UInt32;
  reason @2 :Text;
}

# The group of an epoch is abandoned: every pending and later collective of that epoch fails.
struct Abort {
  epoch @0 :UInt64;

  cause @1 :Text;
  # Why, for people: "worker:2 (rank 2) missed 5 heartbeats".

  lostRanks @2 :List(UInt32);
  # The members that were lost (empty when the abort has another cause).

  atBoundary @3 :Bool;
  # Elastic, a notice (epoch later than the view's) of a join only: the members go on with the
  # current epoch and re-form at their next step boundary, all at the same one, instead of
  # aborting the calls in flight. A later notice of the same epoch without it aborts them.
}

# Everything sent on a membership connection.
struct MembershipMessage {
  union {
    join @0 :Join;
    refusal @1 :Refusal;
    view @2 :View;
    heartbeat @3 :Heartbeat;
    leave @4 :Leave;
    abort @5 :Abort;
    challenge @6 :Challenge;
  }
}

# The first message of the chief on every accepted connection, with or without a shared secret.
struct Challenge {
  nonce @0 :Data;
  # Fresh random bytes (at least 16) that the worker's Join.authProof covers.
}
