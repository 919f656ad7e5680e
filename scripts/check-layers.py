#!/usr/bin/env python3
"""The module layers of each crate, checked (`make lint` runs this).

For each crate (the routing core `core/src`, the filter's adapter `src/`, `protocol/src`,
`bridge/src`, `testkit/src`, `tools/src`) this builds the graph of which module imports which,
from `use crate::...`, `use super::...`, `use self::...`, bare paths into a child module, and fully
qualified `crate::x::y` / `super::x` paths in code. Comments, strings, `#[cfg(test)]` items (test
modules, test-only imports) and test files are left out. It fails:

* on an import cycle, at any level of the module tree: the children of every module (the crate
  root's top-level modules, `config`'s sections, ...) must import each other without a cycle;
* for the core (`core/src`, crate kv-router-core), on an import that goes up the layer order
  declared in `LAYERS` below, and on any use of the filter crate (`envoy_kv_router`: the core
  never imports the adapter; Cargo enforces it too, as the filter depends on the core);
* for the filter (`src/`, crate envoy-kv-router), on a top-level module that is not the adapter
  (`ADAPTER`): everything else belongs in the core. Its `crate::config::...` paths name the core's
  modules, which `src/lib.rs` re-exports;
* in every crate, on a use of the `proxy_wasm` crate outside `src/proxy/`.

A path is charged to the module file that defines the item: re-exports (`pub use child::X` in
`config.rs`, so `crate::config::X`) are followed to the child. A child using an item its parent
file defines (`super::X`) is Rust's nesting, not counted as a cycle; the parent using its children
is downward.

Usage: scripts/check-layers.py [--graph]   (--graph also prints every crate's import arrows)
Only the standard library; Python 3.8+.
"""

import os
import re
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The core's layers (kv-router-core, `core/src`), bottom first. A module may import modules of its
# own layer or of a lower one, never of a higher one (a cycle inside a layer is caught by the cycle
# check). Every top-level module of `core/src` must be listed exactly once. The adapter (`ADAPTER`,
# the filter crate `src/`) is the layer above them all.
LAYERS = [
    # 0. Vocabulary: ids and hash newtypes, the index's bound, route errors, text excerpts, the
    #    seedable random source, the shared-data store trait.
    ("base", ["types", "text", "route_error", "rng", "store"]),
    # 1. Configuration: raw JSON -> the compiled, immutable `Config` every layer above reads.
    ("config", ["config"]),
    # 2. The request: parsing a body, the prompt's text and renderings, block hashes of its tokens.
    ("request", ["request", "prompt_text", "render", "hashing", "lazy_hash"]),
    # 3. Wire: reading what workers send (the event page parser and the binary and log codecs, the
    #    vetting of a worker's description of itself). The wire types shared with the bridge and
    #    the mock (the description, the page's `load`, the id bound) are the `kv-router-protocol`
    #    crate's, re-exported here. Parsing a page hashes its token ids, hence above `request`.
    ("wire", ["worker_description", "events"]),
    # 4. State the filter keeps, shared between VMs or not: the KV index, the load table and its
    #    store, approximate (predicted) blocks, the replicated log, membership, the polling plan and
    #    the tick's cadence.
    ("state", [
        "index", "load", "load_store", "approx", "replication", "membership", "polling", "tick",
    ]),
    # 5. The decision: filters -> costs (TTFT model, its learning, priority, affinity) -> pick, and
    #    the router that runs them for one request.
    ("decide", [
        "filters", "affinity", "learn", "prefill_work", "ttft", "priority", "cost", "select", "router",
    ]),
    # 6. The request path, from a request's headers to the release of its load, over the small
    #    `Host` trait (no host calls of its own).
    ("path", ["request_path"]),
]

# 7. The proxy-wasm adapter, the filter crate (envoy-kv-router, `src/`): the only code that talks
#    to the host. Its top-level modules; it may import every layer of the core (re-exported by
#    `src/lib.rs`), the core never imports it.
ADAPTER = ("adapter", ["proxy"])

# Import cycles tolerated for now, each with its reason. A cycle among modules that are all in one
# entry is printed but does not fail; an entry no cycle needs any more is reported so it can go.
# Keys: the crate and the module paths (`a::b`) allowed to import each other in a cycle.
ALLOWED_CYCLES = {
    # None: the adapter's members/learning <-> vm cycle went with issue 39's restructuring (`vm`
    # defines the types the VM state holds).
}

CORE = "core/src"
FILTER = "src"
CRATES = [
    (CORE, "core/src/lib.rs"),
    (FILTER, "src/lib.rs"),
    ("protocol", "protocol/src/lib.rs"),
    ("bridge", "bridge/src/lib.rs"),
    ("testkit", "testkit/src/lib.rs"),
    ("tools", "tools/src/lib.rs"),
]

USED_EXCEPTIONS = set()

# The only part of any crate that may use the `proxy_wasm` crate: the filter's `src/proxy/`.
PROXY_WASM_OWNER = (FILTER, "proxy")


# ----------------------------------------------------------------------------------------------
# Source text: comments and literals blanked, test-only items removed (line numbers kept).


def blank(text, start, end):
    """`text[start:end]` replaced by spaces, newlines kept."""
    return "".join(c if c == "\n" else " " for c in text[start:end])


def strip_comments_and_literals(src):
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        nxt = src[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(src, i, j))
            i = j
        elif c == "/" and nxt == "*":
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(src, i, j))
            i = j
        elif c in "rb" and re.match(r"(?:br|r)#*\"", src[i:i + 260]) and not (
            i and (src[i - 1].isalnum() or src[i - 1] == "_")
        ):
            m = re.match(r"(?:br|r)(#*)\"", src[i:])
            close = '"' + m.group(1)
            j = src.find(close, i + m.end())
            j = n if j < 0 else j + len(close)
            out.append(src[i] + blank(src, i + 1, j))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append('"' + blank(src, i + 1, j) + '"')
            i = j + 1
        elif c == "'":
            # A char literal ('x', '\n', '\u{1F600}') or a lifetime ('a).
            m = re.match(r"'(?:\\(?:u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'])'", src[i:i + 16])
            if m:
                out.append(" " * m.end())
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


TEST_CFG = re.compile(r"#\[\s*cfg\s*\(\s*(?:test\s*\)|all\s*\(\s*test\b)")


def item_end(text, i):
    """The end of the item starting at `i`: its first `;` outside brackets, or its closing brace."""
    depth, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0 and c == "}":
                return i + 1
        elif c == ";" and depth == 0:
            return i + 1
        i += 1
    return n


def strip_test_items(text):
    """Blanks every item under `#[cfg(test)]` (or `#[cfg(all(test, ...))]`), attributes included."""
    while True:
        m = TEST_CFG.search(text)
        if not m:
            return text
        # Skip the attributes (this one and any that follow), then the item.
        i = j = m.start()
        while True:
            a = re.compile(r"\s*#\[").match(text, j)
            if not a:
                break
            j = item_end_bracket(text, a.end() - 1)
        j = item_end(text, j)
        text = text[:i] + blank(text, i, j) + text[j:]


def item_end_bracket(text, i):
    """`text[i]` is `[`: the index after its matching `]`."""
    depth = 0
    while i < len(text):
        if text[i] == "[":
            depth += 1
        elif text[i] == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return len(text)


def clean_source(path):
    with open(path, encoding="utf-8") as f:
        return strip_test_items(strip_comments_and_literals(f.read()))


# ----------------------------------------------------------------------------------------------
# The module tree of a crate (files only; inline modules are part of their file).

MOD_DECL = re.compile(r"(?m)^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")


def module_tree(crate_root):
    """{module path (tuple): file}, from the crate root's `mod x;` declarations, test modules out."""
    modules = {}

    def visit(path, file, owns_dir):
        modules[path] = file
        text = clean_source(file)
        base = os.path.dirname(file) if owns_dir else os.path.splitext(file)[0]
        for m in MOD_DECL.finditer(text):
            name = m.group(1)
            for cand, owns in ((os.path.join(base, name + ".rs"), False),
                               (os.path.join(base, name, "mod.rs"), True)):
                if os.path.exists(cand):
                    visit(path + (name,), cand, owns)
                    break
            else:
                sys.exit(f"check-layers: {file}: no file for `mod {name};`")

    visit((), crate_root, True)
    return modules


# ----------------------------------------------------------------------------------------------
# Paths a file names.

USE_STMT = re.compile(r"\buse\s+([^;]*);")
INLINE_MOD = re.compile(r"\bmod\s+(\w+)\s*\{")
QUALIFIED = re.compile(r"(?<![\w:$])((?:crate|super|self)(?:\s*::\s*(?:\w+))+)")


def expand_use_tree(tree):
    """`a::{b as x, c::{d, self}, *}` -> [([a, b], x), ([a, c, d], d), ([a, c], c), ([a], None)]:
    each path with the name it brings into scope (None for a glob)."""
    tree = re.sub(r"\s+as\s+", "@", tree)
    tree = re.sub(r"\s+", "", tree)

    def parse(s, i, prefix):
        out, seg = [], ""
        while i < len(s):
            c = s[i]
            if c == "{":
                items, i = parse(s, i + 1, prefix + [p for p in seg.split("::") if p])
                out.extend(items)
                seg = None
                continue
            if c == "}":
                if seg:
                    out.append(finish(prefix, seg))
                return out, i + 1
            if c == ",":
                if seg:
                    out.append(finish(prefix, seg))
                seg = ""
            else:
                seg = (seg or "") + c
            i += 1
        if seg:
            out.append(finish(prefix, seg))
        return out, i

    def finish(prefix, seg):
        seg, _, alias = seg.partition("@")
        parts = [p for p in seg.split("::") if p]
        glob = parts[-1:] == ["*"]
        parts = [p for p in parts if p != "*"]
        path = list(prefix) if parts == ["self"] else list(prefix) + parts
        if glob:
            return path, None
        return path, alias or (path[-1] if path else None)

    return parse(tree, 0, [])[0]


def inline_module_ranges(text):
    """[(start, end, name)] of the inline (non-test) modules of a file."""
    ranges = []
    for m in INLINE_MOD.finditer(text):
        end = item_end(text, m.end() - 1)
        ranges.append((m.start(), end, m.group(1)))
    return ranges


def resolve(segments, here, modules, external=()):
    """An absolute module path for a path written in module `here`, or None if not crate-local.
    `external`: top-level names the crate re-exports from another crate (the filter's glob
    re-export of the core's modules): a path into one of them is that crate's, not local."""
    segs = list(segments)
    if not segs:
        return None
    if segs[0] == "crate":
        cur, segs = (), segs[1:]
    elif segs[0] in ("super", "self"):
        cur = tuple(here)
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                if not cur:
                    return None
                cur = cur[:-1]
            segs = segs[1:]
    elif tuple(here) + (segs[0],) in modules:
        cur = tuple(here)  # a bare path into a child module
    else:
        return None
    out = cur + tuple(segs)
    if out and out[0] in external and (out[0],) not in modules:
        return None
    return out


def owning_file_module(path, modules, reexports=None):
    """The deepest module with its own file that `path` is inside of; a name that module only
    re-exports (`pub use child::X;`, or a `use` its children reach as `super::X`) is followed to the
    module it comes from."""
    p = tuple(path)
    for _ in range(16):
        rest = ()
        while p not in modules:
            p, rest = p[:-1], (p[-1],) + rest
        origin = (reexports or {}).get(p, {}).get(rest[0]) if rest else None
        if origin is None or owning_file_module(origin, modules) == p:
            return p
        p = tuple(origin) + rest[1:]
    return p


def reexports_of(mod_path, text, modules, external=()):
    """{name: absolute path} for the names a module brings in with `use` (its re-exports)."""
    out = {}
    for m in USE_STMT.finditer(text):
        for segs, bound in expand_use_tree(m.group(1).strip().lstrip(":")):
            target = resolve(segs, mod_path, modules, external)
            if target and bound and bound not in ("self", "super", "crate"):
                out[bound] = target
    return out


def imports_of(mod_path, file, modules, reexports, external=()):
    """[(target module, line, the path as written)] for every crate-local path the file names."""
    text = clean_source(file)
    inline = inline_module_ranges(text)

    def here_at(pos):
        extra = [name for (s, e, name) in inline if s < pos < e]
        return tuple(mod_path) + tuple(extra)

    found = []

    def add(segs, pos, written):
        here = here_at(pos)
        target = resolve(segs, here, modules, external) if segs else None
        if target is None:
            return
        node = owning_file_module(target, modules, reexports)
        line = text.count("\n", 0, pos) + 1
        found.append((node, line, written))

    use_spans = []
    for m in USE_STMT.finditer(text):
        use_spans.append((m.start(), m.end()))
        stmt = m.group(1).strip().lstrip(":")
        written = re.sub(r"\s+", " ", m.group(1)).strip()
        for segs, _ in expand_use_tree(stmt):
            add(segs, m.start(), written)

    def in_use(pos):
        return any(s <= pos < e for s, e in use_spans)

    for m in QUALIFIED.finditer(text):
        if in_use(m.start()):
            continue
        segs = re.sub(r"\s+", "", m.group(1)).split("::")
        add(segs, m.start(), m.group(1))
    # Bare paths into a child module in code (`compile::compile(raw)`).
    children = {p[-1] for p in modules if len(p) == len(mod_path) + 1 and p[:-1] == tuple(mod_path)}
    if children:
        bare = re.compile(r"(?<![\w:$.])(" + "|".join(sorted(children)) + r")\s*::\s*\w+")
        for m in bare.finditer(text):
            if in_use(m.start()):
                continue
            add([m.group(1)], m.start(), re.sub(r"\s+", "", m.group(0)))
    return found, text


# ----------------------------------------------------------------------------------------------
# Checks.


def name(path):
    return "::".join(path) if path else "crate"


def sccs(nodes, edges):
    """Tarjan: strongly connected components with more than one node."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def a_cycle(comp, edges):
    """One cycle through the component's first node, as a list of nodes (first repeated last)."""
    comp_set = set(comp)
    start = comp[0]
    prev, queue = {start: None}, [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges.get(v, ())):
            if w not in comp_set:
                continue
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return comp + [start]


def core_modules():
    """The top-level module names of the core (what the filter's `src/lib.rs` re-exports)."""
    return {p[0] for p in module_tree(os.path.join(ROOT, CRATES[0][1])) if p}


def check_crate(crate, crate_root, show_graph):
    modules = module_tree(os.path.join(ROOT, crate_root))
    external = core_modules() if crate == FILTER else ()
    # File-level arrows with their evidence.
    arrows = defaultdict(list)  # (from, to) -> [(file, line, written)]
    texts = {}
    reexports = {p: reexports_of(p, clean_source(f), modules, external) for p, f in modules.items()}
    for mod_path, file in sorted(modules.items()):
        found, text = imports_of(mod_path, file, modules, reexports, external)
        texts[mod_path] = (file, text)
        for target, line, written in found:
            if target != mod_path:
                arrows[(mod_path, target)].append((os.path.relpath(file, ROOT), line, written))

    errors, notes = [], []

    # Cycles: at every module with children, among its children (itself counted as one).
    parents = sorted({p[:k] for p in modules for k in range(len(p))})
    for parent in parents:
        depth = len(parent)

        def group(p):
            if p[:depth] != parent:
                return None
            return parent if len(p) == depth else parent + (p[depth],)

        edges = defaultdict(set)
        evidence = {}
        for (a, b), ev in arrows.items():
            ga, gb = group(a), group(b)
            if ga is None or gb is None or ga == gb:
                continue
            if gb == parent:
                # A child naming an item its parent defines (`super::X`): the parent's own items
                # are its children's context, as Rust nests them; not counted as a cycle.
                continue
            edges[ga].add(gb)
            evidence.setdefault((ga, gb), (a, b, ev[0]))
        nodes = {group(p) for p in modules if group(p) is not None}
        for comp in sccs(nodes, edges):
            cyc = a_cycle(comp, edges)
            allowed = [k for k in ALLOWED_CYCLES
                       if k[0] == crate and {name(c) for c in comp} <= set(k[1])]
            lines = []
            for a in comp:  # every arrow inside the cycle, with one import that makes it
                for b in sorted(edges[a] & set(comp)):
                    fa, fb, (file, line, written) = evidence[(a, b)]
                    lines.append(f"    {name(a)} -> {name(b)}   ({file}:{line}: {written})")
            title = " -> ".join(name(c) for c in cyc)
            if len(comp) > len(cyc) - 1:
                title += f"   (all of {{{', '.join(name(c) for c in comp)}}} are in one cycle)"
            if allowed:
                USED_EXCEPTIONS.add(allowed[0])
                notes.append(f"{crate}: allowed cycle ({ALLOWED_CYCLES[allowed[0]]}): {title}\n"
                             + "\n".join(lines))
            else:
                errors.append(f"{crate}: import cycle: {title}\n" + "\n".join(lines)
                              + "\n    break it by moving the shared item down into the module it"
                              " belongs to (or a new lower one).")

    if crate == CORE:
        errors += check_layers(modules, arrows, texts)
    if crate == FILTER:
        errors += check_adapter(modules)
    errors += check_proxy_wasm(crate, texts)

    if show_graph:
        print(f"# {crate}: {len(modules)} modules, {len(arrows)} import arrows")
        for (a, b) in sorted(arrows):
            print(f"  {name(a)} -> {name(b)}")
    return errors, notes


def check_layers(modules, arrows, texts):
    errors = []
    layer_of = {}
    for rank, (_, mods) in enumerate(LAYERS):
        for m in mods:
            if m in layer_of:
                errors.append(f"{CORE}: LAYERS lists `{m}` twice")
            layer_of[m] = rank
    top = {p[0] for p in modules if p}
    for m in sorted(top - set(layer_of)):
        errors.append(f"{CORE}: module `{m}` is in no layer: add it to LAYERS in "
                      f"scripts/check-layers.py")
    for m in sorted(set(layer_of) - top):
        errors.append(f"{CORE}: LAYERS lists `{m}`, which is not a module of {CORE}/")
    seen = set()
    for (a, b), ev in sorted(arrows.items()):
        if not a or not b or a[0] == b[0]:
            continue
        la, lb = layer_of.get(a[0]), layer_of.get(b[0])
        if la is None or lb is None or lb <= la:
            continue
        if (a[0], b[0]) in seen:
            continue
        seen.add((a[0], b[0]))
        file, line, written = ev[0]
        errors.append(
            f"{CORE}: upward import: {name(a)} (layer {LAYERS[la][0]}) imports {name(b)} "
            f"(layer {LAYERS[lb][0]})\n    {file}:{line}: {written}\n"
            f"    a module may only import its own layer or lower ones "
            f"({' < '.join(n for n, _ in LAYERS + [ADAPTER])}); move the item down.")
    # The core never imports the filter (the adapter above it).
    up = re.compile(r"(?<![\w$])envoy_kv_router\s*::|\bextern\s+crate\s+envoy_kv_router\b")
    for mod_path, (file, text) in sorted(texts.items()):
        m = up.search(text)
        if m:
            line = text.count("\n", 0, m.start()) + 1
            errors.append(f"{CORE}: {os.path.relpath(file, ROOT)}:{line}: imports the filter crate "
                          f"(`envoy_kv_router`, layer {ADAPTER[0]}); the core never imports the "
                          f"adapter: move the item down into the core.")
    return errors


def check_adapter(modules):
    """The filter crate (`src/`) is the adapter alone: its top-level modules are `ADAPTER`'s."""
    errors = []
    top = {p[0] for p in modules if p}
    for m in sorted(top - set(ADAPTER[1])):
        errors.append(f"{FILTER}: module `{m}` is not the adapter ({', '.join(ADAPTER[1])}): the "
                      f"filter crate holds only the proxy-wasm adapter; move `{m}` into {CORE}/ "
                      f"(kv-router-core, a layer in LAYERS) or add it to ADAPTER in "
                      f"scripts/check-layers.py")
    return errors


def check_proxy_wasm(crate, texts):
    """Only the filter's `src/proxy/` uses the `proxy_wasm` crate."""
    errors = []
    pw = re.compile(r"(?<![\w$])proxy_wasm\s*::|\bextern\s+crate\s+proxy_wasm\b")
    for mod_path, (file, text) in sorted(texts.items()):
        if (crate, mod_path[:1]) == (PROXY_WASM_OWNER[0], (PROXY_WASM_OWNER[1],)):
            continue
        m = pw.search(text)
        if m:
            line = text.count("\n", 0, m.start()) + 1
            errors.append(f"{crate}: {os.path.relpath(file, ROOT)}:{line}: uses the `proxy_wasm` "
                          f"crate; only {FILTER}/{PROXY_WASM_OWNER[1]}/ (the adapter) may")
    return errors


def main():
    show_graph = "--graph" in sys.argv[1:]
    errors, notes = [], []
    for crate, root in CRATES:
        e, n = check_crate(crate, root, show_graph)
        errors += e
        notes += n
    for key in sorted(set(ALLOWED_CYCLES) - USED_EXCEPTIONS):
        notes.append(f"{key[0]}: the allowed cycle among {', '.join(key[1])} is gone: delete its "
                     f"entry from ALLOWED_CYCLES in scripts/check-layers.py")
    for n in notes:
        print(f"check-layers: note: {n}")
    if errors:
        for e in errors:
            print(f"check-layers: error: {e}", file=sys.stderr)
        print(f"check-layers: {len(errors)} error(s); layers and exceptions are declared in "
              f"scripts/check-layers.py (see docs/DESIGN.md, Layers)", file=sys.stderr)
        return 1
    print(f"check-layers: ok ({', '.join(c for c, _ in CRATES)}: no import cycles; {CORE} imports "
          f"only downward, {FILTER} is the adapter alone; proxy_wasm only in "
          f"{FILTER}/{PROXY_WASM_OWNER[1]}/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
