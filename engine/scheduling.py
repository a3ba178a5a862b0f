"""The waiting queue's admission order, one function per ``engine.scheduling`` policy.

The scheduler admits waiting sequences in the order its policy returns, as far as the step's
token budget, ``max_num_seqs`` and the pool allow. Every policy returns a permutation of the
queue and puts the preempted sequences (which the scheduler requeues at the front) first: they
were running (and may have KV parked in the swap tier), so they go back in before anything new.
``fcfs`` and ``dfs-weight`` keep them in queue order; ``lpm`` and ``lof`` sort them by their key too.

* ``fcfs``: queue order, first come first served.
* ``lpm``: longest cached prefix first (asks the backend for each sequence's match), so the
  requests that can reuse the pool run while their blocks are still in it. Ties keep queue order.
* ``dfs-weight``: SGLang's depth-first walk of the radix tree of the waiting sequences' cached
  prefixes. Each sequence sits at the node of the last block the cache holds of it; a node's
  weight is the number of sequences at or below it; the walk visits heavier subtrees first and a
  node's subtrees before the sequences sitting at it. So sequences that reuse the same cached
  prefix are admitted one after another, the biggest group first, and the longest cached prefix
  of a group goes first. The sequences with nothing cached follow (SGLang leaves them in queue
  order), walked the same way over the tree of their own prompts' blocks, so a group sharing a
  prefix not cached yet runs together too: the member with the longest shared path computes it,
  and the rest reuse it before other groups evict it.
* ``lof``: longest expected output first, the expected output being the tokens ``max_tokens``
  still allows (``max_tokens`` minus those already generated): long decodes start early and do not
  end the run as a tail of nearly empty steps. Ties keep queue order.

Each policy is a pure function of the queue (and, for ``lpm`` and ``dfs-weight``, of a match count
per sequence), so its properties hold, and are tested, whatever the backend.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Sequence as SequenceABC
from itertools import chain

from corekv.engine.sequence import Sequence

__all__ = ["ORDER_BY_POLICY", "DFS_WEIGHT_QUEUE_LIMIT", "order_fcfs", "order_lpm", "order_dfs_weight",
           "order_lof", "expected_output_tokens"]

#: ``dfs-weight`` walks at most this many new sequences (the oldest) each step and leaves later
#: ones in queue order: its cost (a match and a hash count per sequence) grows with the queue,
#: and a step should not spend longer ordering the queue than running its Python side.
DFS_WEIGHT_QUEUE_LIMIT = 512

#: how many cached blocks the backend would give a sequence now (``len(BlockManager.match(seq))``)
MatchCount = Callable[[Sequence], int]


def order_fcfs(waiting: SequenceABC[Sequence], num_matched_blocks: MatchCount) -> list[Sequence]:
    """Queue order (preempted sequences are already at its front)."""
    return list(waiting)


def order_lpm(waiting: SequenceABC[Sequence], num_matched_blocks: MatchCount) -> list[Sequence]:
    """Preempted first, then the longest cached prefix first; ties keep queue order."""
    # NOTE: sorted() is stable, so ties stay first come, first served.
    return sorted(waiting, key=lambda s: (s.num_preemptions == 0, -num_matched_blocks(s)))


def order_lof(waiting: SequenceABC[Sequence], num_matched_blocks: MatchCount) -> list[Sequence]:
    """Preempted first, then the longest expected output first; ties keep queue order."""
    return sorted(waiting, key=lambda s: (s.num_preemptions == 0, -expected_output_tokens(s)))


def order_dfs_weight(waiting: SequenceABC[Sequence], num_matched_blocks: MatchCount) -> list[Sequence]:
    """Preempted first; then the sequences with a cached prefix, in a heaviest-subtree-first walk
    of the tree of those prefixes; then the others, in the same walk over their prompts' blocks.

    In both trees a node is a chained block hash (it names its whole prefix, so the previous
    block's hash is its parent) and a sequence sits at the node of its path's last block (the root
    for an empty path). For every node, the sequences whose path runs through it come out
    contiguous; heavier children first (ties: the child a sequence reached first in queue order),
    then the sequences sitting at the node itself. Only the first ``DFS_WEIGHT_QUEUE_LIMIT``
    new sequences are walked; later ones follow in queue order.

    NOTE: children before the node's own sequences (SGLang's order, not the reverse): the
    sequence with the longest path computes the blocks that every shorter one sharing it then
    hits, as a conversation's latest turn holds the history its earlier turns are prefixes of.
    The other way round, each shorter sequence computes a little and the longer ones wait behind
    it while other groups evict what it left (see BENCHMARKS.md, "Scheduling policies").
    """
    preempted = [s for s in waiting if s.num_preemptions]
    fresh = [s for s in waiting if not s.num_preemptions]
    fresh, beyond = fresh[:DFS_WEIGHT_QUEUE_LIMIT], fresh[DFS_WEIGHT_QUEUE_LIMIT:]
    cached_paths = [(s, s.key.block_hashes[:num_matched_blocks(s)]) for s in fresh]
    hot = [(s, path) for s, path in cached_paths if path]
    cold = [(s, s.key.block_hashes) for s, path in cached_paths if not path]
    return preempted + _dfs_weight_walk(hot) + _dfs_weight_walk(cold) + beyond


def expected_output_tokens(seq: Sequence) -> int:
    """What ``lof`` ranks by: the tokens ``max_tokens`` still allows ``seq`` to generate.

    NOTE: ``max_tokens`` is an upper bound (EOS or a stop string may end a request sooner), but it
    is the only length a request states up front, as in SGLang's ``lof``.
    """
    return seq.params.max_tokens - seq.num_output_tokens


#: ``engine.scheduling`` -> its order function
ORDER_BY_POLICY: dict[str, Callable[[SequenceABC[Sequence], MatchCount], list[Sequence]]] = {
    "lpm": order_lpm,
    "fcfs": order_fcfs,
    "dfs-weight": order_dfs_weight,
    "lof": order_lof,
}


def _dfs_weight_walk(seqs_and_paths: SequenceABC[tuple[Sequence, list]]) -> list[Sequence]:
    """The sequences in a depth-first, heaviest-child-first, children-before-own walk of the tree
    their paths (lists of chained block hashes) form."""
    # NOTE: the walk visits only blocks on two or more paths. ``num_holders[h]`` (the paths
    # holding h) is the weight of h's subtree, and it never grows along a path: the shared blocks
    # are a prefix of each path, found by bisection. Below them a sequence is alone, in a subtree
    # of weight 1, lighter than every shared child; these "tails" come after the shared children,
    # in queue order, which is where a walk of the whole tree puts them. So the Python work is
    # per shared block, not per block (1,000 waiting 1K-token prompts hold 64K blocks), beyond one
    # C-level count per block; and the walk is iterative (a 100K-token prompt is 6K blocks deep).
    num_holders = Counter(chain.from_iterable(path for _, path in seqs_and_paths))
    children: dict[object, list[object]] = {None: []}  # None is the root
    seqs_at: dict[object, list[Sequence]] = {}
    tails_below: dict[object, list[Sequence]] = {}
    for seq, path in seqs_and_paths:
        depth = bisect_left(path, -1, key=lambda h: -num_holders[h])  # the leading shared blocks
        node = path[depth - 1] if depth else None
        (seqs_at if depth == len(path) else tails_below).setdefault(node, []).append(seq)
        known = depth  # register the shared path below its deepest node already known
        while known and path[known - 1] not in children:
            known -= 1
        for i in range(known, depth):
            children[path[i]] = []
            children[path[i - 1] if i else None].append(path[i])
    order: list[Sequence] = []
    stack: list[tuple[object, bool]] = [(None, False)]
    while stack:
        node, is_expanded = stack.pop()
        if is_expanded:  # its children are done: its tails, then the sequences sitting at it
            order.extend(tails_below.get(node, ()))
            order.extend(seqs_at.get(node, ()))
            continue
        stack.append((node, True))
        # NOTE: a child joins its parent's list while its first holder (in queue order) is
        # registered, so the lists are in first-seen order and the stable sort keeps it for ties.
        ranked = sorted(children[node], key=lambda child: -num_holders[child])
        stack.extend((child, False) for child in reversed(ranked))
    return order
