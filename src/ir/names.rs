//! The one name authority of a model: every name a pass mints comes from here.
//!
//! It knows every name the model has ever held (values, nodes, bodies included), so a
//! fresh name never collides with an existing one and a name freed by a removal is never
//! handed out again (a reused name would silently rewire a subgraph capture).

use std::collections::HashSet;

#[derive(Clone, Debug, Default)]
pub struct NameAuthority {
    taken: HashSet<String>,
}

impl NameAuthority {
    /// Marks `name` as taken (used by import for every existing name).
    pub fn reserve(&mut self, name: &str) {
        if !name.is_empty() {
            self.taken.insert(name.to_string());
        }
    }

    pub fn is_taken(&self, name: &str) -> bool {
        self.taken.contains(name)
    }

    /// `hint` itself when free, else `hint_1`, `hint_2`, ... The result is reserved.
    pub fn fresh(&mut self, hint: &str) -> String {
        let hint = if hint.is_empty() { "v" } else { hint };
        let mut candidate = hint.to_string();
        let mut n = 1usize;
        while self.taken.contains(&candidate) {
            candidate = format!("{hint}_{n}");
            n += 1;
        }
        self.taken.insert(candidate.clone());
        candidate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_names_never_collide_nor_repeat() {
        let mut names = NameAuthority::default();
        names.reserve("x");
        assert_eq!(names.fresh("x"), "x_1");
        assert_eq!(names.fresh("x"), "x_2");
        assert_eq!(names.fresh("y"), "y");
        assert_eq!(names.fresh("y"), "y_1");
        assert_eq!(names.fresh(""), "v");
    }
}
