"""Opening an LMDB store safely: its data file checked before anything maps it, once a process.

LMDB maps ``data.mdb`` whole, and reading a mapped page past the file's end kills the process
with SIGBUS, which no exception handler sees. :func:`check_lmdb_file` reads the file's meta
pages, and every B-tree page they reach, with plain file reads and says what is wrong;
:func:`open_lmdb` opens a store only after that check and only when this process does not hold
it open already, turning LMDB's own open failures into errors that name the fix. The ``lmdb``
tier and its admin view both open their store through it, and close it with :func:`close_lmdb`.
"""
from __future__ import annotations

import os
import struct
import threading
from array import array

import lmdb

from corekv.errors import ConfigError, describe_exception

# LMDB's file layout on a 64-bit build (lmdb's mdb.c: MDB_page, MDB_meta, MDB_db, MDB_node), in
# the machine's byte order. Pages 0 and 1 are meta pages; the one with the larger txnid is current.
_PAGE_HEADER = struct.Struct("=QHHHH")  # mp_pgno, mp_pad, mp_flags, mp_lower, mp_upper
_META = struct.Struct("=II")  # at byte 16: mm_magic, mm_version (mm_address, mm_mapsize follow)
# mm_dbs[0], the free-page DB, at byte 40: md_pad (the page size here), md_flags, md_depth,
# md_branch_pages, md_leaf_pages, md_overflow_pages, md_entries, md_root
_META_DB = struct.Struct("=IHHQQQQQ")
_META_TAIL = struct.Struct("=QQ")  # at byte 136, after mm_dbs[1]: mm_last_pg, mm_txnid
_META_BYTES = 152
_NODE = struct.Struct("=HHHH")  # mn_lo, mn_hi, mn_flags, mn_ksize; the key, then the data follow
_MAGIC, _DATA_VERSION, _NO_PAGE = 0xBEEFC0DE, 1, 2**64 - 1
_P_BRANCH, _P_LEAF, _P_META, _P_LEAF2 = 0x01, 0x02, 0x08, 0x20
_F_BIGDATA, _F_SUBDATA = 0x01, 0x02
_open_paths: set[str] = set()  # real paths this process holds open
_open_paths_lock = threading.Lock()
_DAMAGED = ("the store is damaged: move its folder away or delete it (corekv store clear cannot "
            "read it either), or point path elsewhere")


def check_lmdb_file(path: str | os.PathLike) -> str | None:
    """Why the LMDB environment in directory ``path`` must not be opened, or ``None`` when it may.

    LMDB maps ``data.mdb`` whole, and reading a mapped page past the file's end kills the process
    with SIGBUS, which no exception handler sees. So this reads the two meta pages with plain file
    reads, before anything maps the file, and checks that the file holds every page the newer one
    counts. Pages at the end that are free need not be in the file (LMDB writes a page when it
    uses one and never reads a free one), so a shorter file is truncated only when the free-page
    DB does not list every missing page. Then every B-tree page is read once and each node, size
    and page number checked to lie inside its page and the file (LMDB trusts them: a leaf's data
    size past the file is a SIGBUS when the entry is copied). Measured: 0.2 ms for a 40-block
    store, one read per tree page (a store of 20 GiB of 700 KB blocks has a few hundred).
    The answer names the file, what is wrong and the fix.
    ``None`` also for a missing folder or ``data.mdb`` or an empty one: LMDB starts a fresh store.
    """
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return (f"{path} is a file, not a directory; point path at a directory for the LMDB store "
                "(it is created when missing), or move the file away")
    data_path = os.path.join(path, "data.mdb")
    if not os.path.lexists(data_path) or struct.calcsize("P") != 8:
        return None  # NOTE: the layout read here is a 64-bit build's; a 32-bit one goes unchecked
    try:
        with open(data_path, "rb") as file:
            problem, txnid = _check_data_file(file, data_path)
            for _ in range(2):
                # NOTE: a writer in another process may commit while the free-page DB is read and
                # reuse its pages; the verdict stands only when no commit happened meanwhile.
                if problem is None:
                    break
                again, txnid_again = _check_data_file(file, data_path)
                if txnid_again == txnid:
                    break
                problem, txnid = again, txnid_again
            return problem
    except OSError as e:
        return (f"{data_path} cannot be read ({describe_exception(e)}); make it a file this user "
                "can read and write, or point path elsewhere")


def open_lmdb(path: str, **options) -> lmdb.Environment:
    """``lmdb.open(path, **options)`` once :func:`check_lmdb_file` finds nothing wrong, creating
    the folder when missing; close it with :func:`close_lmdb`.

    NOTE: LMDB forbids opening one environment twice in a process (the second open's locks do
    not see the first's readers), so a path this process holds open is refused.

    :raises ValueError: this process holds ``path`` open already.
    :raises ConfigError: for ``path``, naming what is wrong and the fix, for a store that
        :func:`check_lmdb_file` rejects or that LMDB fails to open.
    """
    real_path = os.path.realpath(path)
    with _open_paths_lock:
        if real_path in _open_paths:
            raise ValueError(f"LMDB path {real_path!r} is already open in this process; LMDB "
                             "forbids opening it twice: share the one LMDBTier object, or close "
                             "it first")
        env = _open_checked(path, **options)
        _open_paths.add(real_path)
    return env


def close_lmdb(env: lmdb.Environment) -> None:
    """Close a store :func:`open_lmdb` opened, so this process may open its path again."""
    real_path = os.path.realpath(env.path())
    env.close()
    with _open_paths_lock:
        _open_paths.discard(real_path)


def _open_checked(path: str, **options) -> lmdb.Environment:
    problem = check_lmdb_file(path)
    if problem is not None:
        raise ConfigError(problem, path="path")
    try:
        os.makedirs(path, exist_ok=True)
        return lmdb.open(path, **options)
    except (OSError, lmdb.Error) as e:
        if isinstance(e, (lmdb.InvalidError, lmdb.VersionMismatchError)):
            # NOTE: data.mdb passed the check, so LMDB rejected lock.mdb, which it rebuilds by
            # itself unless another process holds it open.
            fix = ("its lock.mdb is not one this lmdb reads and another process holds it: stop the "
                   "processes that use the store, then delete lock.mdb (LMDB makes a new one)")
        else:
            fix = ("it must be a folder this user can read and write: fix its permissions, or "
                   "point path elsewhere")
        raise ConfigError(f"LMDB cannot open the store at {path} ({describe_exception(e)}); {fix}",
                          path="path") from e


def _check_data_file(file, data_path: str) -> tuple[str | None, int | None]:
    """``check_lmdb_file``'s answer for the open ``data.mdb`` and the txnid of its current meta."""
    first = _read_at(file, 0, _META_BYTES)
    if not first:
        return None, None  # zero bytes: LMDB writes the meta pages of an empty store
    if len(first) < _META_BYTES:
        return f"{data_path} is {len(first)} bytes, too short for LMDB's meta page; {_DAMAGED}", None
    problem = _meta_problem(first, 0)
    page_bytes = _META_DB.unpack_from(first, 40)[0]
    if problem is None and not (512 <= page_bytes <= 65536 and page_bytes & (page_bytes - 1) == 0):
        problem = f"meta page 0 names a page size of {page_bytes} bytes"
    if problem is not None:
        return f"{data_path} is not an LMDB data file ({problem}); {_DAMAGED}", None
    second = _read_at(file, page_bytes, _META_BYTES)
    # NOTE: the size is read after the meta pages: a writer grows the file before its meta page
    # names the new pages, so this order never sees a meta page ahead of the file.
    num_bytes = os.fstat(file.fileno()).st_size
    if len(second) < _META_BYTES:
        return _truncated(data_path, num_bytes, 2 * page_bytes), None
    problem = _meta_problem(second, 1)
    if problem is not None:
        return f"{data_path} is not an LMDB data file ({problem}); {_DAMAGED}", None
    last_page, txnid, free_root, main_root = max(
        ((*_META_TAIL.unpack_from(meta, 136), _META_DB.unpack_from(meta, 40)[7],
          _META_DB.unpack_from(meta, 88)[7])
         for meta in (first, second)), key=lambda fields: fields[1])  # the newer meta page
    need_bytes = (last_page + 1) * page_bytes
    num_pages = min(num_bytes // page_bytes, last_page + 1)
    if num_bytes < need_bytes:
        free = _free_pages(file, free_root, page_bytes, num_pages)
        if free is None or sum(1 for p in free if p <= last_page) != last_page + 1 - num_pages:
            return _truncated(data_path, num_bytes, need_bytes), txnid
    problem = _tree_problem(file, (free_root, main_root), page_bytes, num_pages)
    if problem is not None:
        return f"{data_path} is damaged ({problem}); {_DAMAGED}", txnid
    return None, txnid


def _meta_problem(page: bytes, index: int) -> str | None:
    """What LMDB's own check of a meta page (``mdb_env_read_header``) would reject, or ``None``."""
    flags = _PAGE_HEADER.unpack_from(page)[2]
    magic, version = _META.unpack_from(page, 16)
    if magic != _MAGIC:
        return f"meta page {index} has magic {magic:#010x}, not LMDB's {_MAGIC:#x}"
    if not flags & _P_META:
        return f"page {index} is not marked as a meta page"
    if version != _DATA_VERSION:
        return (f"meta page {index} has data format version {version}; this lmdb reads "
                f"{_DATA_VERSION}")
    return None


def _truncated(data_path: str, num_bytes: int, need_bytes: int) -> str:
    return (f"{data_path} is truncated: {num_bytes} of the {need_bytes} bytes its meta page names; "
            f"{_DAMAGED}")


def _free_pages(file, root: int, page_bytes: int, num_pages: int) -> set[int] | None:
    """The free page numbers from ``num_pages`` on, read from the free-page DB rooted at ``root``
    (a B-tree of ID lists: ``[count, page numbers...]``); ``None`` when a page of that DB is
    missing from the file or is not a B-tree page."""
    found: set[int] = set()
    todo, seen = ([] if root == _NO_PAGE else [root]), set()
    try:
        while todo:
            page_number = todo.pop()
            if page_number in seen or page_number >= num_pages:
                return None
            seen.add(page_number)
            page = _read_at(file, page_number * page_bytes, page_bytes)
            _, _, flags, lower, _ = _PAGE_HEADER.unpack_from(page)
            if not flags & (_P_BRANCH | _P_LEAF) or not _PAGE_HEADER.size <= lower <= page_bytes:
                return None
            for (offset,) in struct.iter_unpack("=H", page[_PAGE_HEADER.size:lower & ~1]):
                lo, hi, node_flags, key_bytes = _NODE.unpack_from(page, offset)
                if flags & _P_BRANCH:
                    todo.append(lo | hi << 16 | node_flags << 32)  # a child's page number
                    continue
                data_bytes, start = lo | hi << 16, offset + _NODE.size + key_bytes
                if node_flags & _F_BIGDATA:  # the list lives on overflow pages from this one
                    (first,) = struct.unpack_from("=Q", page, start)
                    data = (_read_at(file, first * page_bytes + _PAGE_HEADER.size, data_bytes)
                            if first < num_pages else b"")
                else:
                    data = page[start:start + data_bytes]
                if len(data) != data_bytes or data_bytes < 8 or data_bytes % 8:
                    return None
                ids = array("Q", data)
                if ids[0] >= len(ids):
                    return None
                found.update(p for p in ids[1:ids[0] + 1] if p >= num_pages)
    except struct.error:  # a node offset past the page's end
        return None
    return found


def _tree_problem(file, roots: tuple[int, ...], page_bytes: int, num_pages: int) -> str | None:
    """What is wrong with the B-trees reachable from the meta page's ``roots`` (the free-page DB
    and the main DB, whose sub-DB records add their own roots), or ``None``.

    NOTE: LMDB trusts every size and page number it finds on a page: a leaf node whose data size
    or overflow page reaches past the file's end is a SIGBUS when the entry is copied. So each
    page reachable from the meta page is read once (at most ``num_pages`` reads, the overflow
    pages excepted: their page numbers and sizes are checked, their data is not read) and every
    node must lie inside its page, every page number and overflow run inside the file.
    """
    todo, seen = [root for root in roots if root != _NO_PAGE], set()
    while todo:
        page_number = todo.pop()
        if page_number >= num_pages:
            return f"a B-tree names page {page_number}, past the file's {num_pages} pages"
        if page_number in seen:
            return f"page {page_number} is reached twice in the B-trees"
        seen.add(page_number)
        page = _read_at(file, page_number * page_bytes, page_bytes)
        if len(page) < page_bytes:
            return f"page {page_number} is cut short"
        problem = _page_problem(page, page_number, page_bytes, num_pages, todo)
        if problem is not None:
            return f"page {page_number}: {problem}"
    return None


def _page_problem(page: bytes, page_number: int, page_bytes: int, num_pages: int,
                  todo: list[int]) -> str | None:
    """What is wrong with one branch or leaf page; its children and sub-DB roots go to ``todo``."""
    stored_number, _, flags, lower, upper = _PAGE_HEADER.unpack_from(page)
    if stored_number != page_number:
        return f"its header names page {stored_number}"
    if flags & _P_LEAF2:
        return None  # NOTE: fixed-size duplicate keys only; corekv's stores have none
    if not flags & (_P_BRANCH | _P_LEAF):
        return f"flags {flags:#x} are neither branch nor leaf"
    if not (_PAGE_HEADER.size <= lower <= upper <= page_bytes) or lower % 2:
        return f"free space [{lower}, {upper}) is outside the page"
    for (offset,) in struct.iter_unpack("=H", page[_PAGE_HEADER.size:lower]):
        if not upper <= offset <= page_bytes - _NODE.size:
            return f"a node at byte {offset} is outside the page's nodes [{upper}, {page_bytes})"
        lo, hi, node_flags, key_bytes = _NODE.unpack_from(page, offset)
        data_at = offset + _NODE.size + key_bytes
        if flags & _P_BRANCH:
            if data_at > page_bytes:
                return f"a key of {key_bytes} bytes at byte {offset} runs past the page"
            todo.append(lo | hi << 16 | node_flags << 32)
            continue
        data_bytes = lo | hi << 16
        if node_flags & _F_BIGDATA:
            if data_at + 8 > page_bytes:
                return f"a node at byte {offset} runs past the page"
            (first,) = struct.unpack_from("=Q", page, data_at)
            last = first + -(-(_PAGE_HEADER.size + data_bytes) // page_bytes)
            if first < 2 or last > num_pages:
                return (f"an entry of {data_bytes} bytes on pages [{first}, {last}) runs past the "
                        f"file's {num_pages} pages")
            continue
        if data_at + data_bytes > page_bytes:
            return f"an entry of {data_bytes} bytes at byte {offset} runs past the page"
        if node_flags & _F_SUBDATA:  # a named DB's record: its own B-tree
            if data_bytes != _META_DB.size:
                return f"a named DB's record is {data_bytes} bytes, not {_META_DB.size}"
            root = _META_DB.unpack_from(page, data_at)[7]
            if root != _NO_PAGE:
                todo.append(root)
    return None


def _read_at(file, offset: int, num_bytes: int) -> bytes:
    file.seek(offset)
    return file.read(num_bytes)
