//! `train --draw-seed SEED`: every node of a session that draws random numbers (a training
//! Dropout's mask, `RandomNormal`/`RandomUniform` and their `Like` forms, `Bernoulli`,
//! `Multinomial`, ONNX Runtime's `BiasDropout`, `BitmaskDropout`, `BiasSoftmaxDropout`)
//! gets a `seed` attribute, so that two runs with the same seed draw the same numbers.
//!
//! Without one, ONNX Runtime seeds each such kernel from the clock or the OS and tract from
//! the OS: a run with dropout cannot be repeated. With one, each kernel keeps its own
//! generator, seeded once when the session is made, and advances it on every run (ONNX
//! Runtime's `RandomGenerator::NextSeed` per `Compute`; tract's op state, which the engine
//! keeps across runs): every micro-step draws anew, and the sequence is the seed's.
//!
//! Each node's seed is derived from the run's seed, the session (the split runner's window
//! start, accumulate and apply specialisations each run the forward pass, and with one seed
//! they would draw the same masks at the same count of their own runs) and the node's place
//! in the graph, so no two generators of a run start alike. A node that already has a
//! `seed` keeps it: the model's author chose it.
//!
//! A resumed run seeds its sessions the same way, so from the resume point on it draws what
//! the first run drew from its start, not what the first run would have drawn next: it is
//! reproducible (the same resume point gives the same run), not a continuation.

use crate::proto::attribute_proto::AttributeType;
use crate::proto::{AttributeProto, GraphProto, ModelProto};

/// Which of a trainer's sessions a model is, for its nodes' seeds (the discriminant is
/// part of every seed, so it must not change between versions without reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionRole {
    Whole = 0,
    Accumulate = 1,
    WindowStart = 2,
    Apply = 3,
}

/// The ops that draw, by domain, and whether their `seed` attribute is an int (else a float).
const DRAWING: &[(&str, &str, SeedKind)] = &[
    ("", "Dropout", SeedKind::Int),
    ("", "RandomNormal", SeedKind::Float),
    ("", "RandomUniform", SeedKind::Float),
    ("", "RandomNormalLike", SeedKind::Float),
    ("", "RandomUniformLike", SeedKind::Float),
    ("", "Bernoulli", SeedKind::Float),
    ("", "Multinomial", SeedKind::Float),
    ("com.microsoft", "BiasDropout", SeedKind::Int),
    ("com.microsoft", "BitmaskDropout", SeedKind::Int),
    ("com.microsoft", "BiasSoftmaxDropout", SeedKind::Int),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SeedKind {
    Int,
    /// A float attribute that ONNX Runtime converts to a 32-bit unsigned integer and tract
    /// reads as a float: kept below 2^24, where every integer is exact in float32.
    Float,
}

/// Seeds every drawing node of `model` (at any depth: If branches, Loop and Scan bodies)
/// that has no seed; returns how many were seeded.
pub fn seed_draws(model: &mut ModelProto, seed: u64, role: SessionRole) -> usize {
    let Some(graph) = model.graph.as_mut() else {
        return 0;
    };
    let base = mix(mix(seed) ^ role as u64);
    seed_graph(graph, base)
}

/// The seed rank `rank` of a data-parallel job seeds its sessions from: each rank draws
/// its own masks (with one seed they would draw the same ones for different rows); rank 0
/// the run's seed itself.
pub fn for_rank(seed: u64, rank: usize) -> u64 {
    match rank {
        0 => seed,
        rank => mix(seed ^ mix(rank as u64)),
    }
}

/// Whether `model` has a node that draws random numbers (seeded or not).
pub fn draws(model: &ModelProto) -> bool {
    fn any(graph: &GraphProto) -> bool {
        graph.node.iter().any(|node| {
            kind_of(node.domain(), node.op_type()).is_some()
                || node.attribute.iter().any(|a| subgraphs(a).any(any))
        })
    }
    model.graph.as_ref().is_some_and(any)
}

fn seed_graph(graph: &mut GraphProto, path: u64) -> usize {
    let mut seeded = 0;
    for (index, node) in graph.node.iter_mut().enumerate() {
        // The node's place: its index in its body, the body's place, its op and its name.
        let here = mix(path ^ mix(index as u64 + 1) ^ bytes_hash(node.op_type().as_bytes()))
            ^ bytes_hash(node.name().as_bytes());
        let here = mix(here);
        if let Some(kind) = kind_of(node.domain(), node.op_type()) {
            if !node.attribute.iter().any(|a| a.name() == "seed") {
                node.attribute.push(seed_attribute(kind, here));
                seeded += 1;
            }
        }
        for (a, attribute) in node.attribute.iter_mut().enumerate() {
            let attribute_path = mix(here ^ (a as u64 + 1));
            if let Some(g) = attribute.g.as_mut() {
                seeded += seed_graph(g, mix(attribute_path));
            }
            for (b, g) in attribute.graphs.iter_mut().enumerate() {
                seeded += seed_graph(g, mix(attribute_path ^ mix(b as u64 + 1)));
            }
        }
    }
    seeded
}

fn subgraphs(attribute: &AttributeProto) -> impl Iterator<Item = &GraphProto> {
    attribute.g.iter().chain(attribute.graphs.iter())
}

fn kind_of(domain: &str, op: &str) -> Option<SeedKind> {
    let domain = crate::ir::normalize_domain(domain);
    DRAWING
        .iter()
        .find(|(d, o, _)| *d == domain && *o == op)
        .map(|(_, _, kind)| *kind)
}

fn seed_attribute(kind: SeedKind, value: u64) -> AttributeProto {
    match kind {
        // Non-negative: ONNX Runtime's CPU Dropout takes it as an unsigned seed.
        SeedKind::Int => AttributeProto {
            name: Some("seed".into()),
            r#type: Some(AttributeType::Int as i32),
            i: Some((value >> 1) as i64),
            ..Default::default()
        },
        SeedKind::Float => AttributeProto {
            name: Some("seed".into()),
            r#type: Some(AttributeType::Float as i32),
            f: Some((value >> 40) as f32),
            ..Default::default()
        },
    }
}

/// SplitMix64's finaliser: a bijection of u64 whose outputs of nearby inputs look unrelated.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a of `bytes`.
fn bytes_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeds(model: &ModelProto) -> Vec<(String, Option<i64>, Option<f32>)> {
        fn walk(graph: &GraphProto, out: &mut Vec<(String, Option<i64>, Option<f32>)>) {
            for node in &graph.node {
                if let Some(seed) = node.attribute.iter().find(|a| a.name() == "seed") {
                    out.push((node.name().to_string(), seed.i, seed.f));
                }
                for a in &node.attribute {
                    subgraphs(a).for_each(|g| walk(g, out));
                }
            }
        }
        let mut out = Vec::new();
        walk(model.graph.as_ref().unwrap(), &mut out);
        out
    }

    fn model() -> ModelProto {
        crate::ir::text::parse_model(
            r#"<ir_version: 8, opset_import: ["" : 17]>
            g (float[4] x, bool c) => (float[4] y) {
              [d1] a, m = Dropout (x)
              [u1] u = RandomUniformLike (a)
              [kept] k = RandomNormalLike <seed = 5.0> (u)
              [branch] y = If (c) <
                then_branch = t () => (float[4] yt) { [d2] yt = Dropout (k) },
                else_branch = e () => (float[4] ye) { [d3] ye, me = Dropout (k) }
              >
            }"#,
        )
        .unwrap()
    }

    /// Every drawing node is seeded, at any depth; a seed the model gives is kept; the same
    /// seed and session give the same seeds, and another seed or session others, all distinct.
    #[test]
    fn every_draw_gets_a_seed_of_its_own_and_the_run_s() {
        let mut a = model();
        assert!(draws(&a));
        assert_eq!(seed_draws(&mut a, 7, SessionRole::Accumulate), 4);
        let seen = seeds(&a);
        let names: Vec<&str> = seen.iter().map(|(n, _, _)| n.as_str()).collect();
        assert_eq!(names, ["d1", "u1", "kept", "d2", "d3"]);
        assert_eq!(seen[2].2, Some(5.0), "the model's own seed is kept");
        assert!(seen[0].1.is_some_and(|i| i >= 0) && seen[1].2.is_some_and(|f| f < 16_777_216.0));
        assert!(seen[1].2.is_some_and(|f| f.fract() == 0.0));

        let mut again = model();
        seed_draws(&mut again, 7, SessionRole::Accumulate);
        assert_eq!(
            seeds(&again),
            seen,
            "the same seed and session: the same seeds"
        );

        let ints = |m: &ModelProto| -> Vec<i64> { seeds(m).iter().filter_map(|s| s.1).collect() };
        let mut other_role = model();
        seed_draws(&mut other_role, 7, SessionRole::Apply);
        let mut other_seed = model();
        seed_draws(&mut other_seed, 8, SessionRole::Accumulate);
        let mut all: Vec<i64> = [&a, &other_role, &other_seed]
            .iter()
            .flat_map(|m| ints(m))
            .collect();
        assert_eq!(all.len(), 9);
        all.sort_unstable();
        all.dedup();
        assert_eq!(
            all.len(),
            9,
            "every Dropout of the three seedings has its own seed"
        );

        // Seeding a seeded model changes nothing.
        assert_eq!(seed_draws(&mut a, 9, SessionRole::Whole), 0);
    }

    /// Rank 0 seeds as a single process does; every other rank from a seed of its own.
    #[test]
    fn each_rank_draws_from_its_own_seed() {
        assert_eq!(for_rank(7, 0), 7);
        let mut seeds: Vec<u64> = (0..64).map(|rank| for_rank(7, rank)).collect();
        seeds.extend((0..64).map(|rank| for_rank(8, rank)));
        seeds.sort_unstable();
        seeds.dedup();
        assert_eq!(seeds.len(), 128);
    }

    #[test]
    fn a_model_without_draws_says_so() {
        let model = crate::ir::text::parse_model(
            r#"<ir_version: 8, opset_import: ["" : 17]>
            g (float[4] x) => (float[4] y) { y = Relu (x) }"#,
        )
        .unwrap();
        assert!(!draws(&model));
    }
}
