//! The dependency graph the crate READMEs promise, checked from `cargo tree` (run by `cargo xtask test`): the
//! scheduler is free of tensors and models, and `tlt-spec-decode` without its default features (the Llama
//! adapter) is model-agnostic and still builds. And inside every crate: no files that import each other in a
//! circle (the rules are written above [`FileGraph`]; `cargo xtask graph` prints the graphs).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use tracing::info;

use crate::workspace::workspace_root;

/// Which crates may not appear below which package (with which `cargo tree` arguments).
const RULES: &[(&str, &[&str], &[&str])] = &[
    ("tlt-scheduler", &[], &["candle-core", "candle-nn", "tlt-model", "tokenizers"]),
    ("tlt-spec-decode", &["--no-default-features"], &["candle-core", "tlt-model", "tokenizers"]),
    ("tlt-spec-decode", &[], &["cudarc"]),
    ("tlt-drafter", &[], &["cudarc"]),
    ("tlt-kernels", &[], &["candle-core", "tlt-model", "tokenizers", "cudarc"]),
    ("tlt-kernels", &["--features", "cuda"], &["candle-core", "tlt-model", "tokenizers"]),
    ("tlt-cudagraph", &[], &["candle-core", "tlt-model", "tokenizers"]),
];

/// The package names in `cargo tree` output (normal, build and dev edges), one per line.
fn tree(cargo: impl Fn() -> Command, package: &str, extra: &[&str]) -> Result<Vec<String>> {
    let mut cmd = cargo();
    cmd.args(["tree", "--prefix", "none", "--format", "{p}", "-p", package]).args(extra);
    let out = cmd.output().with_context(|| format!("running cargo tree -p {package}"))?;
    if !out.status.success() {
        bail!("cargo tree -p {package} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect())
}

/// Fails naming the first forbidden dependency found; then checks that `tlt-spec-decode` builds (with clippy)
/// without its default features.
pub fn check(cargo: impl Fn() -> Command) -> Result<()> {
    let graphs = workspace_graphs(&workspace_root())?;
    let (new, known) = circles_beyond_known(&graphs, KNOWN_CIRCLES);
    for k in &known {
        tracing::warn!("known import circle, still to break: {k}");
    }
    if !new.is_empty() {
        bail!(
            "files of one crate import each other in a circle (`cargo xtask graph` shows the graph):\n  {}",
            new.join("\n  ")
        );
    }
    info!(roots = graphs.len(), known = known.len(), "no new import circles between the files of any crate");
    for (package, extra, forbidden) in RULES {
        let names = tree(&cargo, package, extra)?;
        if let Some(bad) = names.iter().find(|n| forbidden.contains(&n.as_str())) {
            bail!("{package} {} depends on {bad}: its README promises it does not", extra.join(" "));
        }
        info!(package, ?extra, deps = names.len(), "dependency graph as documented");
    }
    let status = cargo()
        .args(["clippy", "-p", "tlt-spec-decode", "--no-default-features", "--all-targets", "--", "-D", "warnings"])
        .status()
        .context("running clippy on tlt-spec-decode without default features")?;
    if !status.success() {
        bail!("tlt-spec-decode does not build cleanly without its default features");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------------
// Module cycles inside each crate.
//
// Files import each other with `use`; when two files of one crate import each other (directly or through others)
// neither can be read, tested or moved alone. The check below draws each crate's file graph from the code and fails
// on any circle. The rules it follows:
//
// - **Nodes.** Every crate root (`src/lib.rs`, `src/main.rs`, `src/bin/*.rs`, `src/bin/*/main.rs`) is walked
//   through its `mod x;` declarations (`x.rs` or `x/mod.rs`, or a `#[path]` attribute's file), so a node is a file
//   and its module path is where `mod` put it. Inline `mod x { .. }` blocks belong to the file they are written in.
//   A root's own graph holds only the files its `mod` tree reaches (a binary's `main.rs` and the library are
//   separate crates to rustc, and to this check).
// - **Tests.** `#[cfg(test)]` modules, inline or in a file of their own, are left out: a test module may reach
//   into anything of its parent.
// - **Edges.** A path that starts with `crate::`, `self::`, `super::` or the name of a child module of the current
//   module, in a `use` (grouped `use a::{b, c::d}` expanded) or in code, points to the file of the deepest module it
//   names; a path to an item (`crate::a::X`) points to the file of the module that defines `X`. A `mod x;`
//   declaration is not an edge (it is the tree itself); a reference to one's own child is.
// - **Re-exports.** A name a module imports (`use`, `pub use`, globs included) rather than defines is followed to
//   the file that defines it, so `use crate::Foo` where `lib.rs` has `pub use a::Foo` points to `a.rs`, not to
//   `lib.rs`; a name that resolves outside the crate is no edge. A `pub use` (any `pub(..)` too) is the module's
//   façade and adds no edge of its own: `lib.rs` and `mod.rs` re-export their children without depending on them.
//   A private `use` is an edge.
// - **Ignored.** Comments, doc comments, string and character literals; `$crate` in macros; paths through `Self`.
//
// A strongly connected component of more than one file is a circle; it is printed as one cycle through it
// (`a.rs -> b.rs -> a.rs`, paths under the crate's `src/`). A circle listed in `KNOWN_CIRCLES` is reported, not
// failed, while it does not grow; the list is empty (the circles found when this check was written are broken).
// ---------------------------------------------------------------------------------------------------------------

/// A token of Rust source with comments and literals' contents gone (strings kept: `#[path]` needs them).
#[derive(Debug, Clone, PartialEq)]
enum Tok {
    /// An identifier, keyword or number.
    Ident(String),
    /// `::`.
    Sep,
    /// One punctuation character.
    Punct(char),
    /// A string literal's raw text (escapes left as written).
    Str(String),
}

/// Splits Rust source into [`Tok`]s, skipping comments (nested block comments too), character literals and
/// lifetimes.
fn lex(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let (mut out, mut i) = (Vec::new(), 0);
    let ident = |ch: char| ch.is_alphanumeric() || ch == '_';
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            let mut depth = 0usize;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == '"' {
            let start = i + 1;
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            out.push(Tok::Str(c[start..i.min(c.len())].iter().collect()));
            i += 1;
        } else if (ch == 'r' || (ch == 'b' && next == Some('r')))
            && (i == 0 || !ident(c[i - 1]))
            && raw_string_start(&c, i + usize::from(ch == 'b') + 1).is_some()
        {
            // r"..", r#".."#, br".." (no escapes; ends at a quote followed by as many hashes).
            let open = i + usize::from(ch == 'b') + 1;
            let hashes = raw_string_start(&c, open).unwrap_or(0);
            let start = open + hashes + 1;
            i = start;
            loop {
                if i >= c.len() {
                    break;
                }
                if c[i] == '"' && (0..hashes).all(|k| c.get(i + 1 + k) == Some(&'#')) {
                    break;
                }
                i += 1;
            }
            out.push(Tok::Str(c[start..i.min(c.len())].iter().collect()));
            i += 1 + hashes;
        } else if ch == '\'' {
            // A character literal ('x', '\n', '\u{..}', '{') or a lifetime ('a): only the literal is skipped whole.
            if next == Some('\\') {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
                while i < c.len() && ident(c[i]) {
                    i += 1;
                }
            }
        } else if ident(ch) {
            let start = i;
            while i < c.len() && ident(c[i]) {
                i += 1;
            }
            out.push(Tok::Ident(c[start..i].iter().collect()));
        } else if ch == ':' && next == Some(':') {
            out.push(Tok::Sep);
            i += 2;
        } else {
            if !ch.is_whitespace() {
                out.push(Tok::Punct(ch));
            }
            i += 1;
        }
    }
    out
}

/// At `c[i]`: the number of `#` of a raw string's opening (`#*"`), or `None` when none starts there.
fn raw_string_start(c: &[char], i: usize) -> Option<usize> {
    let hashes = c.get(i..)?.iter().take_while(|&&ch| ch == '#').count();
    (c.get(i + hashes) == Some(&'"')).then_some(hashes)
}

/// A path as written: the module it was written in (absolute, from the crate root) and its segments.
type Written = (Vec<String>, Vec<String>);

/// What the check knows of one module.
#[derive(Debug, Default)]
struct Module {
    /// The file it is written in.
    file: usize,
    /// Its child modules (`mod` declarations, inline or not; `#[cfg(test)]` ones left out).
    children: BTreeSet<String>,
    /// Names of the items it defines.
    defines: BTreeSet<String>,
    /// Names it imports (`use`, `pub use`), with the path each stands for.
    imports: BTreeMap<String, Written>,
    /// Its glob imports (`use a::*`).
    globs: Vec<Written>,
}

/// One crate root's file graph.
#[derive(Debug, Default)]
pub struct FileGraph {
    /// The files, by the path of each under the crate's `src/` (the root first).
    pub files: Vec<String>,
    /// `edges[f]`: the files that file `f` references.
    pub edges: Vec<BTreeSet<usize>>,
}

/// Reads a file of the crate (`None`: no such file).
type Read<'a> = &'a dyn Fn(&Path) -> Option<String>;

/// Builds the file graph of the crate rooted at `root` (a path under `src`, which names the files).
fn file_graph(src: &Path, root: &Path, read: Read<'_>) -> FileGraph {
    let mut g = Builder { src, read, files: Vec::new(), modules: BTreeMap::new(), refs: Vec::new() };
    g.load(root, Vec::new(), true);
    let mut edges = vec![BTreeSet::new(); g.files.len()];
    for (file, module, segs) in &g.refs {
        if let Some(to) = g.resolve(module, segs, 0) {
            if to != *file {
                edges[*file].insert(to);
            }
        }
    }
    let name = |p: &PathBuf| p.strip_prefix(src).unwrap_or(p).to_string_lossy().replace('\\', "/");
    FileGraph { files: g.files.iter().map(name).collect(), edges }
}

/// The state of [`file_graph`] while it reads a crate.
struct Builder<'a> {
    src: &'a Path,
    read: Read<'a>,
    files: Vec<PathBuf>,
    modules: BTreeMap<Vec<String>, Module>,
    /// Every path written: the file, the module it was written in, its segments.
    refs: Vec<(usize, Vec<String>, Vec<String>)>,
}

impl Builder<'_> {
    /// Reads `path` as module `module` (`mod_rs`: a crate root or `mod.rs`, whose children sit beside it), then the
    /// files of its `mod` declarations.
    fn load(&mut self, path: &Path, module: Vec<String>, mod_rs: bool) {
        let Some(text) = (self.read)(path) else { return };
        let file = self.files.len();
        self.files.push(path.to_path_buf());
        let dir = match (mod_rs, path.parent()) {
            (true, Some(d)) => d.to_path_buf(),
            (false, Some(d)) => d.join(path.file_stem().unwrap_or_default()),
            (_, None) => self.src.to_path_buf(),
        };
        let here = path.parent().unwrap_or(self.src).to_path_buf();
        let toks = lex(&text);
        let mut p = Parse { toks: &toks, i: 0 };
        let mut scopes = vec![(module.clone(), 0usize, dir)];
        self.modules.entry(module).or_default().file = file;
        let (mut depth, mut cfg_test, mut path_attr, mut public) = (0usize, false, None::<String>, false);
        while let Some(t) = p.peek().cloned() {
            let (cur, base, cur_dir) = scopes.last().cloned().unwrap_or_default();
            match t {
                Tok::Punct('#') => {
                    let attr = p.attribute();
                    cfg_test |= attr.iter().any(|t| *t == Tok::Ident("cfg".into()))
                        && attr.contains(&Tok::Ident("test".into()))
                        && !attr.contains(&Tok::Ident("not".into()));
                    if attr.first() == Some(&Tok::Ident("path".into())) {
                        path_attr = attr.iter().find_map(|t| match t {
                            Tok::Str(s) => Some(s.clone()),
                            _ => None,
                        });
                    }
                    continue;
                }
                Tok::Ident(ref w) if w == "pub" => {
                    p.i += 1;
                    if p.peek() == Some(&Tok::Punct('(')) {
                        p.skip_group();
                    }
                    public = true;
                    continue;
                }
                Tok::Ident(ref w) if w == "mod" => {
                    p.i += 1;
                    let Some(Tok::Ident(name)) = p.next() else { continue };
                    let inline = p.peek() == Some(&Tok::Punct('{'));
                    if cfg_test {
                        if inline {
                            p.skip_group();
                        }
                    } else {
                        let mut child = cur.clone();
                        child.push(name.clone());
                        self.modules.entry(cur.clone()).or_default().children.insert(name.clone());
                        if inline {
                            p.i += 1;
                            depth += 1;
                            self.modules.entry(child.clone()).or_default().file = file;
                            scopes.push((child, depth, cur_dir.join(&name)));
                        } else if let Some(rel) = path_attr.take() {
                            self.load(&here.join(rel), child, true);
                        } else {
                            let flat = cur_dir.join(format!("{name}.rs"));
                            if (self.read)(&flat).is_some() {
                                self.load(&flat, child, false);
                            } else {
                                self.load(&cur_dir.join(&name).join("mod.rs"), child, true);
                            }
                        }
                    }
                }
                Tok::Ident(ref w) if w == "use" => {
                    p.i += 1;
                    let mut leaves = Vec::new();
                    p.use_tree(Vec::new(), &mut leaves);
                    let m = self.modules.entry(cur.clone()).or_default();
                    for (segs, alias) in leaves {
                        match alias {
                            None => m.globs.push((cur.clone(), segs.clone())),
                            Some(a) if a != "_" => {
                                m.imports.insert(a, (cur.clone(), segs.clone()));
                            }
                            Some(_) => {}
                        }
                        // A re-export is the module's façade, not a use of its own: lookups through it go on
                        // to the origin (see `item`), and it adds no edge.
                        if !public {
                            self.refs.push((file, cur.clone(), segs));
                        }
                    }
                }
                Tok::Ident(ref w)
                    if depth == base
                        && matches!(
                            w.as_str(),
                            "fn" | "struct" | "enum" | "type" | "trait" | "const" | "static" | "union" | "macro_rules"
                        ) =>
                {
                    p.i += 1;
                    if p.peek() == Some(&Tok::Punct('!')) {
                        p.i += 1;
                    }
                    if let Some(Tok::Ident(name)) = p.peek() {
                        self.modules.entry(cur.clone()).or_default().defines.insert(name.clone());
                    }
                }
                Tok::Ident(ref w) if p.toks.get(p.i + 1) == Some(&Tok::Sep) && w != "Self" => {
                    // A path in code: `$crate::` (a `$` before it) belongs to macro callers and is skipped.
                    let dollar = p.i > 0 && p.toks[p.i - 1] == Tok::Punct('$');
                    let segs = p.path();
                    if !dollar {
                        // A re-export is the module's façade, not a use of its own: lookups through it go on
                        // to the origin (see `item`), and it adds no edge.
                        if !public {
                            self.refs.push((file, cur.clone(), segs));
                        }
                    }
                }
                Tok::Punct('{') => {
                    depth += 1;
                    p.i += 1;
                }
                Tok::Punct('}') => {
                    if depth == base && scopes.len() > 1 {
                        scopes.pop();
                    }
                    depth = depth.saturating_sub(1);
                    p.i += 1;
                }
                _ => p.i += 1,
            }
            cfg_test = false;
            path_attr = None;
            public = false;
        }
    }

    /// The module a path written in `module` walks to through module names, and the segments left after it
    /// (`None`: the path does not start in this crate).
    fn walk<'s>(&self, module: &[String], segs: &'s [String]) -> Option<(Vec<String>, &'s [String])> {
        let (mut cur, mut rest) = (module.to_vec(), segs);
        let child = |cur: &Vec<String>, name: &str| self.modules.get(cur).is_some_and(|m| m.children.contains(name));
        match rest.first().map(String::as_str) {
            Some("crate") => {
                cur.clear();
                rest = &rest[1..];
            }
            Some("self" | "super") => {}
            Some(first) if child(&cur, first) => {}
            _ => return None,
        }
        while let Some(first) = rest.first() {
            match first.as_str() {
                "super" => {
                    cur.pop()?;
                }
                "self" => {}
                name if child(&cur, name) => cur.push(name.into()),
                _ => break,
            }
            rest = &rest[1..];
        }
        Some((cur, rest))
    }

    /// The file that a path written in `module` points to (`None`: outside the crate, or not a module path).
    fn resolve(&self, module: &[String], segs: &[String], hops: usize) -> Option<usize> {
        let (cur, rest) = self.walk(module, segs)?;
        self.item(&cur, rest.first(), hops)
    }

    /// The file that defines `name` as seen from module `cur` (the module's own file without a name, or when the
    /// name is neither defined nor imported there as far as this scan sees).
    fn item(&self, cur: &[String], name: Option<&String>, hops: usize) -> Option<usize> {
        let m = self.modules.get(cur)?;
        let Some(name) = name else { return Some(m.file) };
        if m.defines.contains(name) || hops > 16 {
            return Some(m.file);
        }
        if let Some((at, target)) = m.imports.get(name) {
            return self.resolve(at, target, hops + 1);
        }
        for (at, glob) in &m.globs {
            if let Some((gm, [])) = self.walk(at, glob) {
                if self.modules.get(&gm).is_some_and(|g| g.defines.contains(name) || g.imports.contains_key(name)) {
                    return self.item(&gm, Some(name), hops + 1);
                }
            }
        }
        Some(m.file)
    }
}

/// A cursor over tokens.
struct Parse<'a> {
    toks: &'a [Tok],
    i: usize,
}

impl Parse<'_> {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.i)
    }

    fn next(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.i).cloned();
        self.i += 1;
        t
    }

    /// At an opening bracket: skips to after its matching close.
    fn skip_group(&mut self) {
        let mut depth = 0usize;
        while let Some(t) = self.next() {
            match t {
                Tok::Punct('(' | '[' | '{') => depth += 1,
                Tok::Punct(')' | ']' | '}') => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        return;
                    }
                }
                _ => {}
            }
        }
    }

    /// At `#`: the tokens inside `#[..]` or `#![..]`, consumed.
    fn attribute(&mut self) -> Vec<Tok> {
        self.i += 1;
        if self.peek() == Some(&Tok::Punct('!')) {
            self.i += 1;
        }
        if self.peek() != Some(&Tok::Punct('[')) {
            return Vec::new();
        }
        let start = self.i + 1;
        self.skip_group();
        self.toks[start..self.i.saturating_sub(1).max(start)].to_vec()
    }

    /// A path in code, `a::b::C`, consumed up to its last identifier (a `::<..>` or `::{` ends it).
    fn path(&mut self) -> Vec<String> {
        let mut segs = Vec::new();
        while let Some(Tok::Ident(s)) = self.peek().cloned() {
            segs.push(s);
            self.i += 1;
            if self.peek() == Some(&Tok::Sep) && matches!(self.toks.get(self.i + 1), Some(Tok::Ident(_))) {
                self.i += 1;
            } else {
                break;
            }
        }
        segs
    }

    /// A `use` tree after `prefix`, up to and including its `;`: each leaf's full path, and the name it binds
    /// (`None` for a glob).
    fn use_tree(&mut self, prefix: Vec<String>, leaves: &mut Vec<(Vec<String>, Option<String>)>) {
        let mut segs = prefix;
        loop {
            match self.next() {
                Some(Tok::Ident(s)) if s == "as" => {
                    if let Some(Tok::Ident(alias)) = self.next() {
                        if let Some(last) = leaves.last_mut() {
                            last.1 = Some(alias);
                        }
                    }
                }
                Some(Tok::Ident(s)) if s == "self" && !segs.is_empty() => {
                    let name = segs.last().cloned();
                    leaves.push((segs.clone(), name));
                }
                Some(Tok::Ident(s)) => {
                    segs.push(s.clone());
                    if self.peek() != Some(&Tok::Sep) {
                        leaves.push((segs.clone(), Some(s)));
                    }
                }
                Some(Tok::Sep) => {}
                Some(Tok::Punct('*')) => leaves.push((segs.clone(), None)),
                Some(Tok::Punct('{')) => {
                    // Each branch of the group starts again from the prefix written before the brace.
                    let base = segs.clone();
                    loop {
                        self.use_tree(base.clone(), leaves);
                        match self.toks.get(self.i - 1) {
                            Some(Tok::Punct(',')) => continue,
                            _ => break,
                        }
                    }
                }
                Some(Tok::Punct(',' | ';' | '}')) | None => return,
                Some(_) => {}
            }
        }
    }
}

impl FileGraph {
    /// The strongly connected components of more than one file (Tarjan), each as its files' indices, sorted.
    pub fn circles(&self) -> Vec<Vec<usize>> {
        struct Tarjan<'g> {
            g: &'g FileGraph,
            index: Vec<Option<usize>>,
            low: Vec<usize>,
            on_stack: Vec<bool>,
            stack: Vec<usize>,
            next: usize,
            out: Vec<Vec<usize>>,
        }
        impl Tarjan<'_> {
            fn visit(&mut self, v: usize) {
                self.index[v] = Some(self.next);
                self.low[v] = self.next;
                self.next += 1;
                self.stack.push(v);
                self.on_stack[v] = true;
                for &w in &self.g.edges[v] {
                    match self.index[w] {
                        None => {
                            self.visit(w);
                            self.low[v] = self.low[v].min(self.low[w]);
                        }
                        Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                        Some(_) => {}
                    }
                }
                if Some(self.low[v]) == self.index[v] {
                    let mut scc = Vec::new();
                    while let Some(w) = self.stack.pop() {
                        self.on_stack[w] = false;
                        scc.push(w);
                        if w == v {
                            break;
                        }
                    }
                    if scc.len() > 1 {
                        scc.sort_unstable();
                        self.out.push(scc);
                    }
                }
            }
        }
        let n = self.files.len();
        let mut t = Tarjan {
            g: self,
            index: vec![None; n],
            low: vec![0; n],
            on_stack: vec![false; n],
            stack: Vec::new(),
            next: 0,
            out: Vec::new(),
        };
        for v in 0..n {
            if t.index[v].is_none() {
                t.visit(v);
            }
        }
        t.out.sort();
        t.out
    }

    /// One line per circle: a shortest cycle through its first file (`a.rs -> b.rs -> a.rs`) and, when the circle
    /// holds more files than that cycle, all of them.
    pub fn cycles(&self) -> Vec<String> {
        self.circles()
            .iter()
            .map(|scc| {
                let start = scc[0];
                // Breadth-first inside the component from `start` back to it.
                let mut prev = BTreeMap::new();
                let mut queue = std::collections::VecDeque::from([start]);
                let mut last = start;
                'bfs: while let Some(v) = queue.pop_front() {
                    for &w in &self.edges[v] {
                        if w == start {
                            last = v;
                            break 'bfs;
                        }
                        if scc.binary_search(&w).is_ok() && !prev.contains_key(&w) {
                            prev.insert(w, v);
                            queue.push_back(w);
                        }
                    }
                }
                let mut path = vec![start, last];
                while let Some(&p) = prev.get(path.last().unwrap_or(&start)) {
                    path.push(p);
                }
                path.reverse();
                let mut line = path.iter().map(|&f| self.files[f].as_str()).collect::<Vec<_>>().join(" -> ");
                if path.len() - 1 < scc.len() {
                    let all: Vec<&str> = scc.iter().map(|&f| self.files[f].as_str()).collect();
                    let _ = write!(line, " (the circle holds {} files: {})", scc.len(), all.join(", "));
                }
                line
            })
            .collect()
    }

    /// The graph as an indented list (each file, then the files it imports) or, with `dot`, a DOT subgraph.
    pub fn render(&self, name: &str, dot: bool) -> String {
        let mut out = String::new();
        if dot {
            let _ = writeln!(out, "  subgraph \"cluster_{name}\" {{\n    label=\"{name}\";");
            for (f, to) in self.edges.iter().enumerate() {
                let _ = writeln!(out, "    \"{name}/{}\";", self.files[f]);
                for &t in to {
                    let _ = writeln!(out, "    \"{name}/{}\" -> \"{name}/{}\";", self.files[f], self.files[t]);
                }
            }
            out.push_str("  }\n");
        } else {
            let _ = writeln!(out, "{name}");
            for (f, to) in self.edges.iter().enumerate() {
                let _ = writeln!(out, "  {}", self.files[f]);
                for &t in to {
                    let _ = writeln!(out, "    -> {}", self.files[t]);
                }
            }
        }
        out
    }
}

/// The crate roots under a package's `src/`: `lib.rs`, `main.rs`, `bin/*.rs`, `bin/*/main.rs`.
fn crate_roots(src: &Path) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["lib.rs", "main.rs"].iter().map(|f| src.join(f)).filter(|p| p.is_file()).collect();
    if let Ok(dir) = std::fs::read_dir(src.join("bin")) {
        let mut bins: Vec<PathBuf> = dir
            .filter_map(|e| e.ok().map(|e| e.path()))
            .map(|p| if p.is_dir() { p.join("main.rs") } else { p })
            .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "rs"))
            .collect();
        bins.sort();
        roots.extend(bins);
    }
    roots
}

/// Every crate root's file graph in the workspace, named `package` (the library) or `package/<root>`: the members
/// of the root `Cargo.toml`, and any other top-level directory with a `Cargo.toml` and a `src/`.
pub fn workspace_graphs(root: &Path) -> Result<Vec<(String, FileGraph)>> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).context("reading the workspace Cargo.toml")?;
    let members = manifest.split_once("members").map_or("", |(_, rest)| rest);
    let members = members.split_once(']').map_or("", |(list, _)| list);
    let mut dirs: BTreeSet<String> = members.split('"').skip(1).step_by(2).map(str::to_owned).collect();
    for entry in std::fs::read_dir(root).context("listing the workspace")?.flatten() {
        let p = entry.path();
        if p.join("Cargo.toml").is_file() && p.join("src").is_dir() {
            dirs.insert(entry.file_name().to_string_lossy().into_owned());
        }
    }
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let mut out = Vec::new();
    for dir in dirs {
        let src = root.join(&dir).join("src");
        for r in crate_roots(&src) {
            let rel = r.strip_prefix(&src).unwrap_or(&r).to_string_lossy().into_owned();
            let name = if rel == "lib.rs" { dir.clone() } else { format!("{dir}/{rel}") };
            out.push((name, file_graph(&src, &r, &read)));
        }
    }
    Ok(out)
}

/// Circles reported, not failed, while their files stay within the listed ones (a circle that grows, or any other,
/// fails): for a circle found in files whose owners are changing them, listed with the reason until it is broken.
/// `(crate root, files under src/)`, `["*"]`: any circle of that root. Every circle this check found when it was
/// written has been broken: the list is empty, and any circle fails.
const KNOWN_CIRCLES: &[(&str, &[&str])] = &[];

/// Every circle of `graphs` as a line `root: a.rs -> b.rs -> a.rs`, split into those not covered by
/// `known_circles` (the check passes [`KNOWN_CIRCLES`]) and those that are.
pub fn circles_beyond_known(
    graphs: &[(String, FileGraph)],
    known_circles: &[(&str, &[&str])],
) -> (Vec<String>, Vec<String>) {
    let (mut new, mut known) = (Vec::new(), Vec::new());
    for (name, g) in graphs {
        for (scc, line) in g.circles().iter().zip(g.cycles()) {
            let listed = known_circles.iter().any(|(root, files)| {
                root == name && (files == &["*"] || scc.iter().all(|&f| files.contains(&g.files[f].as_str())))
            });
            if listed { &mut known } else { &mut new }.push(format!("{name}: {line}"));
        }
    }
    (new, known)
}

/// `cargo xtask graph`: every crate root's file import graph (an indented list, or DOT with `dot`), then the cycle
/// check's result; fails when any crate has a circle.
pub fn print(dot: bool) -> Result<()> {
    let graphs = workspace_graphs(&workspace_root())?;
    if dot {
        println!("digraph modules {{");
    }
    for (name, g) in &graphs {
        print!("{}", g.render(name, dot));
    }
    if dot {
        println!("}}");
    }
    let (new, known) = circles_beyond_known(&graphs, KNOWN_CIRCLES);
    let say = |line: &str| if dot { eprintln!("{line}") } else { println!("{line}") };
    for c in &known {
        say(&format!("known module cycle (listed in xtask/src/graph.rs, still to break): {c}"));
    }
    for c in &new {
        say(&format!("module cycle: {c}"));
    }
    if new.is_empty() {
        say(&format!("module cycles: none new in {} crate roots ({} known)", graphs.len(), known.len()));
        Ok(())
    } else {
        bail!("{} new module cycles", new.len())
    }
}

#[cfg(test)]
mod tests;
