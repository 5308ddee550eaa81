//! The module-cycle check on small in-memory crates, and on this workspace.

use super::*;

/// The graph of an in-memory crate whose files are `(path under src, text)`, rooted at `lib.rs`.
fn graph(files: &[(&str, &str)]) -> FileGraph {
    let src = Path::new("/mem/src");
    let map: BTreeMap<PathBuf, String> = files.iter().map(|(p, t)| (src.join(p), (*t).to_owned())).collect();
    let read = |p: &Path| map.get(p).cloned();
    file_graph(src, &src.join("lib.rs"), &read)
}

fn edges(g: &FileGraph) -> Vec<String> {
    let mut out = Vec::new();
    for (f, to) in g.edges.iter().enumerate() {
        for &t in to {
            out.push(format!("{} -> {}", g.files[f], g.files[t]));
        }
    }
    out
}

const LIB: &str = "mod a;\nmod b;\npub use a::Alpha;\npub use b::{Beta, Gamma};\n";

#[test]
fn a_circle_is_caught_and_printed() {
    let g = graph(&[
        ("lib.rs", LIB),
        ("a.rs", "use crate::b::Beta;\npub struct Alpha(Beta);\n"),
        ("b.rs", "pub struct Beta;\npub struct Gamma(crate::a::Alpha);\n"),
    ]);
    assert_eq!(g.cycles(), vec!["a.rs -> b.rs -> a.rs".to_owned()]);
}

#[test]
fn the_same_crate_with_the_shared_type_moved_down_passes() {
    let g = graph(&[
        ("lib.rs", "mod a;\nmod b;\nmod c;\npub use a::Alpha;\npub use b::{Beta, Gamma};\n"),
        ("a.rs", "use crate::b::Beta;\npub struct Alpha(Beta);\n"),
        // Gamma no longer names Alpha; what both need lives in c.rs, which imports neither.
        ("b.rs", "use crate::c::Shared;\npub struct Beta;\npub struct Gamma(Shared);\n"),
        ("c.rs", "pub struct Shared;\n"),
    ]);
    assert!(g.cycles().is_empty(), "{:?}", g.cycles());
    // lib.rs's `pub use` lines are re-exports, no edges of their own.
    assert_eq!(edges(&g), ["a.rs -> b.rs", "b.rs -> c.rs"]);
}

#[test]
fn root_re_exports_point_to_the_defining_file() {
    // `crate::Alpha` is lib.rs's re-export of a.rs's type: b.rs depends on a.rs, not on lib.rs (which would
    // close a circle with lib.rs's own `pub use b::..`).
    let g = graph(&[
        ("lib.rs", LIB),
        ("a.rs", "pub struct Alpha;\n"),
        ("b.rs", "use crate::Alpha;\npub struct Beta(Alpha);\npub struct Gamma;\n"),
    ]);
    assert!(g.cycles().is_empty(), "{:?}", g.cycles());
    assert!(edges(&g).contains(&"b.rs -> a.rs".to_owned()));
    // A type defined in lib.rs itself is lib.rs's: using it from a file that lib.rs uses (not only re-exports) is a
    // circle.
    let g = graph(&[
        ("lib.rs", "mod a;\nuse a::Alpha;\npub struct Root;\npub fn f(_: Alpha) {}\n"),
        ("a.rs", "pub struct Alpha(crate::Root);\n"),
    ]);
    assert_eq!(g.cycles(), vec!["lib.rs -> a.rs -> lib.rs".to_owned()]);
}

#[test]
fn grouped_imports_super_and_nested_modules() {
    let g = graph(&[
        ("lib.rs", "pub mod t;\nmod c;\n"),
        ("c.rs", "pub struct C;\n"),
        ("t/mod.rs", "mod x;\nmod y;\npub use self::y::Why;\npub use x::Ex;\n"),
        ("t/x.rs", "use crate::{c::C, t::{y::{self}}};\npub struct Ex(C, y::Why);\n"),
        ("t/y.rs", "pub struct Why;\nfn f() -> super::x::Ex { todo!() }\n"),
    ]);
    assert_eq!(g.cycles(), vec!["t/x.rs -> t/y.rs -> t/x.rs".to_owned()]);
    let e = edges(&g);
    assert!(e.contains(&"t/x.rs -> c.rs".to_owned()), "{e:?}");
    // `super::Ex` from a child goes through mod.rs's re-export to x.rs.
    let g = graph(&[
        ("lib.rs", "mod t;\n"),
        ("t/mod.rs", "mod x;\nmod y;\npub use x::Ex;\n"),
        ("t/x.rs", "pub struct Ex;\n"),
        ("t/y.rs", "use super::Ex;\n"),
    ]);
    assert_eq!(edges(&g), ["t/y.rs -> t/x.rs"]);
}

#[test]
fn comments_strings_and_test_modules_are_not_imports() {
    let g = graph(&[
        ("lib.rs", LIB),
        ("a.rs", "pub struct Alpha;\n"),
        (
            "b.rs",
            concat!(
                "// use crate::a::Alpha;\n",
                "/* crate::a::Alpha /* nested */ crate::a::Alpha */\n",
                "/// [`crate::a::Alpha`]\n",
                "pub struct Beta;\n",
                "pub struct Gamma;\n",
                "const S: &str = \"crate::a::Alpha\";\n",
                "const R: &str = r#\"use crate::a::Alpha; \"#;\n",
                "const C: char = '{';\n",
                "fn f<'a>(x: &'a str) -> &'a str { x }\n",
                "#[cfg(test)]\nmod tests {\n    use crate::a::Alpha;\n}\n",
            ),
        ),
    ]);
    assert!(!edges(&g).iter().any(|e| e.starts_with("b.rs")), "{:?}", edges(&g));
    // The negative control: the same reference in code is an edge.
    let g = graph(&[
        ("lib.rs", LIB),
        ("a.rs", "pub struct Alpha;\n"),
        ("b.rs", "const C: char = '{';\npub struct Beta;\npub struct Gamma(crate::a::Alpha);\n"),
    ]);
    assert!(edges(&g).contains(&"b.rs -> a.rs".to_owned()), "{:?}", edges(&g));
}

#[test]
fn path_attributes_and_inline_modules() {
    let g = graph(&[
        ("lib.rs", "mod a;\n"),
        (
            "a.rs",
            "#[path = \"other.rs\"]\nmod inner;\nmod local { pub use super::inner::In; }\npub struct A(local::In);\n",
        ),
        ("other.rs", "pub struct In;\n"),
    ]);
    assert_eq!(edges(&g), ["a.rs -> other.rs"]);
    assert_eq!(g.files, ["lib.rs", "a.rs", "other.rs"]);
}

#[test]
fn the_workspace_has_no_new_circles() {
    let graphs = workspace_graphs(&workspace_root()).unwrap_or_default();
    assert!(graphs.iter().any(|(n, g)| n == "tlt-rl" && g.files.len() > 20), "the scan found tlt-rl's files");
    let (new, known) = circles_beyond_known(&graphs, KNOWN_CIRCLES);
    assert!(new.is_empty() && known.is_empty(), "{new:#?} {known:#?}");
}

#[test]
fn a_known_circle_is_reported_and_a_grown_one_fails() {
    let listed: &[(&str, &[&str])] = &[("tlt-spec-decode", &["drafter.rs", "engine.rs"])];
    let two = graph(&[
        ("lib.rs", "mod drafter;\nmod engine;\n"),
        ("drafter.rs", "use crate::engine::Id;\npub trait Drafter {}\n"),
        ("engine.rs", "pub struct Id;\npub struct E(Box<dyn crate::drafter::Drafter>);\n"),
    ]);
    let (new, known) = circles_beyond_known(&[("tlt-spec-decode".to_owned(), two)], listed);
    assert!(new.is_empty() && known.len() == 1, "{new:?} {known:?}");
    // The same circle through a third file is not the listed one.
    let three = graph(&[
        ("lib.rs", "mod drafter;\nmod engine;\nmod ids;\n"),
        ("drafter.rs", "use crate::ids::Id;\npub trait Drafter {}\n"),
        ("ids.rs", "pub struct Id(crate::engine::E);\n"),
        ("engine.rs", "pub struct E(Box<dyn crate::drafter::Drafter>);\n"),
    ]);
    let (new, known) = circles_beyond_known(&[("tlt-spec-decode".to_owned(), three)], listed);
    assert_eq!((new.len(), known.len()), (1, 0), "{new:?}");
    // In another crate the two-file circle is new.
    let two = graph(&[
        ("lib.rs", "mod drafter;\nmod engine;\n"),
        ("drafter.rs", "use crate::engine::Id;\npub trait Drafter {}\n"),
        ("engine.rs", "pub struct Id;\npub struct E(Box<dyn crate::drafter::Drafter>);\n"),
    ]);
    assert_eq!(circles_beyond_known(&[("tlt-serve".to_owned(), two)], listed).0.len(), 1);
    // With nothing listed, the listed circle fails too.
    let two = graph(&[
        ("lib.rs", "mod drafter;\nmod engine;\n"),
        ("drafter.rs", "use crate::engine::Id;\npub trait Drafter {}\n"),
        ("engine.rs", "pub struct Id;\npub struct E(Box<dyn crate::drafter::Drafter>);\n"),
    ]);
    assert_eq!(circles_beyond_known(&[("tlt-spec-decode".to_owned(), two)], &[]).0.len(), 1);
}
