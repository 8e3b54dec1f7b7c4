//! Parses ONNX's textual syntax (the language of `onnx.parser` / `onnx.printer`, onnx's
//! docs/Syntax.md) into a `ModelProto`, so that tests can state their input graphs as text
//! (`tests/cases/**/*.onnxtxt`), and reads back what `ir::print` writes (`parse_printed`).
//!
//! What it accepts, and how it differs from onnx 1.23's own parser (whose output it matches
//! field for field on what both accept: the unit tests compare with references that
//! onnx made, tests/data/text, from scripts/text-parser-references.py):
//! - a model: the `<key: value, ...>` header (ir_version, opset_import, producer_name,
//!   producer_version, domain, model_version, doc_string, metadata_props), then one graph;
//!   no functions.
//! - a graph: `name (inputs) => (outputs) <initializers and value infos> { nodes }`. An input
//!   with `= {values}` is also an initializer; an entry of the `<...>` list is an initializer
//!   when it has values and a value info when it has none, as in onnx.
//! - types: tensors (`float`, a scalar; `float[]`, unknown rank; `float[N,?,4]`), `seq(..)`,
//!   `optional(..)`, `map(key, ..)`, `sparse_tensor(..)`.
//! - nodes: `[label]` name, domain-qualified op types (`com.microsoft.Gelu`: the domain is
//!   everything before the last dot), attributes before or after the inputs, empty optional
//!   inputs (`""`, or a gap between commas).
//! - attributes: int, float (with `inf`, `nan`), string, lists of those, tensors
//!   (`float[2] {1, 2}`), graphs (an `If` branch), `@ref`; an optional `: type` annotation.
//!   Lists of tensors or graphs are refused (onnx 1.23 silently drops their elements).
//! - a tensor whose value count differs from its shape is an error, not a silently short
//!   tensor; a float beyond float32 (one that rounds to infinity) is an error.
//! - `#` starts a comment to the end of the line, as in onnx: a test case's `# key: value`
//!   lines are comments to the parser.
//!
//! ## The printer's dialect
//!
//! `ir::print` writes ONNX text with a few forms of its own (it is made to be read by people:
//! sorted attributes, branches below their node, provenance marks, long tensors elided). The
//! parser reads all of them, so that every printed graph parses back and prints identically
//! (tests/print_parses_back.rs checks every graph in tests/snapshots/).
//!
//! Read by both `parse_model` and `parse_printed`, since onnx's text gives them no meaning
//! (each was a syntax error before):
//! - value names wider than onnx's identifiers: letters, digits and `_ . : / -`, not starting
//!   with `-` (`w.m`, `onnx::Mul_3`, `/fc1/Gemm_output_0`, `12`): exporters make such names
//!   and the printer writes names unquoted. The same for graph names, dim names and node
//!   labels; `"any text"` stays the way to write any other name.
//! - graph attributes after their node, one per line, as the printer writes an `If`'s or a
//!   `Loop`'s bodies: `y = If (c)` then `else_branch = g () => (...) {...}`; `body[0] = ...`
//!   is element 0 of a list of graphs. A node (`y = Relu (x)`) reads the same up to its
//!   inputs: only a graph has `=>` after them, which decides.
//! - a graph with no name (`body =  () => ...`), a value with no type (`? x`).
//! - `true` and `false` as a bool tensor's values (the printer's form of a bool held as raw
//!   bytes), read into raw_data; integers keep onnx's reading (int32_data).
//! - float literals as a float16 or bfloat16 tensor's values (`{1.5, -0.0}`, the printer's
//!   form of raw 16-bit floats), rounded to the type into raw_data; integers keep onnx's
//!   reading (the bit pattern, in int32_data).
//! - `NaN`, Rust's spelling of a NaN, beside onnx's `nan`.
//!
//! Read only by `parse_printed`, since the same text means something else in onnx's:
//! - an entry of a graph's `<...>` list without values is an initializer whose values the
//!   printer elided (it shows at most 8 elements, of the types whose values it prints), not a
//!   value info (the printer writes none). It is read as zeros of its declared type and shape,
//!   in the field that type's values are read into (float_data, int64_data, int32_data for
//!   bool, the narrow ints and 16-bit floats, uint64_data, string_data of empty strings, raw
//!   zero bytes for complex, 8-, 4- and 2-bit types), so that it prints elided again: the text
//!   round-trips, the values do not. (One of at most 8 elements that was elided for being
//!   stored externally would print its zeros.) The same for a tensor attribute without
//!   values (`value = float[16]`), alone or in a list. More than 2^26 elements is an error.
//! - a `# text` comment that ends a node's line (after its inputs, or its attributes after
//!   them) is the node's provenance: the `onnx_ga.pass` metadata entry (`ir::PASS_KEY`) the
//!   printer shows that way. A comment on a line of its own stays a comment.
//! - strings use Rust's escapes (the printer writes them with `{:?}`): `\n`, `\r`, `\t`,
//!   `\0`, `\u{1b}`; any other escaped character stands for itself. onnx's backslash takes
//!   the next character as it is (`\n` is `n`).
//! - a list of tensors (`[float[2] = {1.0, 2.0}, int64[9]]`), and an empty list `[]` without
//!   a type annotation, read as ints (the printer writes every empty list so; it prints the
//!   same whatever its type).
//!
//! What the printer cannot say does not come back: node names, value infos, doc strings, the
//! header beyond ir_version and opset_import, elided values, which field held a tensor's
//! values, and a tensor type without a shape versus a scalar's empty shape (both print
//! `float`). One form stays ambiguous and is read as a tensor: a TYPE_PROTO attribute (only
//! `Optional`'s `type` has one), which the printer writes as a type (`type = float[10]`),
//! the same text as an elided tensor attribute (and refused when it is not a tensor type).
//!
//! Every error names the line and column (1-based) where the parser stopped.

use std::fmt;

use crate::proto::attribute_proto::AttributeType;
use crate::proto::tensor_proto::DataType;
use crate::proto::tensor_shape_proto::{dimension, Dimension};
use crate::proto::{
    type_proto, AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto,
    StringStringEntryProto, TensorProto, TensorShapeProto, TypeProto, ValueInfoProto,
};

/// A syntax error at a 1-based line and column.
#[derive(Debug, Clone, PartialEq)]
pub struct ParseError {
    pub line: usize,
    pub column: usize,
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.line, self.column, self.message)
    }
}

impl std::error::Error for ParseError {}

/// Parses a whole model: header, then the main graph.
pub fn parse_model(text: &str) -> Result<ModelProto, ParseError> {
    parse_whole(text, false, |p| p.model())
}

/// Parses a model as `ir::print::print_model` wrote it: ONNX text plus the printer's dialect
/// (see the module's documentation): a value-less initializer is an elided one (zeros), a
/// `# pass` comment ending a node's line is its provenance, strings use Rust's escapes.
pub fn parse_printed(text: &str) -> Result<ModelProto, ParseError> {
    parse_whole(text, true, |p| p.model())
}

/// Parses one graph (`name (inputs) => (outputs) {...}`), without a model header.
pub fn parse_graph(text: &str) -> Result<GraphProto, ParseError> {
    parse_whole(text, false, |p| p.graph())
}

/// `read` over the whole of `text` (in the printer's dialect when `printed`): nothing but
/// blanks may follow what it reads.
fn parse_whole<'t, T>(
    text: &'t str,
    printed: bool,
    read: impl FnOnce(&mut Parser<'t>) -> Result<T, ParseError>,
) -> Result<T, ParseError> {
    let mut parser = Parser::new(text);
    parser.printed = printed;
    let parsed = read(&mut parser)?;
    parser.skip_blank();
    if !parser.at_end() {
        return Err(parser.error("expected the end of the text after the graph"));
    }
    Ok(parsed)
}

/// A number as written: the syntax decides int or float, the attribute type may widen.
#[derive(Clone, Copy, Debug)]
enum Number {
    Int(i64),
    Float(f64),
}

/// One element of an attribute list or of a tensor's values.
#[derive(Clone, Debug)]
enum Constant {
    Number(Number),
    Text(Vec<u8>),
    /// `true` or `false`, as the printer writes a bool tensor's values.
    Bool(bool),
}

struct Parser<'a> {
    text: &'a str,
    /// Byte offset of the next character.
    offset: usize,
    /// How many graphs and types are open: recursion is bounded, so a hostile text (a
    /// thousand nested `seq(`) is an error, not a stack overflow.
    depth: usize,
    /// Reading the printer's output (`parse_printed`): the readings that differ from onnx's.
    printed: bool,
}

/// Deepest nesting of graphs (If branches) and types (`seq(seq(...))`) accepted.
const MAX_DEPTH: usize = 64;

impl<'a> Parser<'a> {
    fn new(text: &'a str) -> Self {
        Parser {
            text,
            offset: 0,
            depth: 0,
            printed: false,
        }
    }

    // ---- characters and positions ------------------------------------------------------

    fn rest(&self) -> &'a str {
        &self.text[self.offset..]
    }

    fn at_end(&self) -> bool {
        self.offset >= self.text.len()
    }

    fn peek_char(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn position(&self, offset: usize) -> (usize, usize) {
        let before = &self.text[..offset];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let column = self.text[line_start..offset].chars().count() + 1;
        (line, column)
    }

    fn error(&self, message: impl Into<String>) -> ParseError {
        self.error_at(self.offset, message)
    }

    fn error_at(&self, offset: usize, message: impl Into<String>) -> ParseError {
        let (line, column) = self.position(offset);
        ParseError {
            line,
            column,
            message: message.into(),
        }
    }

    /// Skips whitespace and `#` comments.
    fn skip_blank(&mut self) {
        loop {
            let rest = self.rest();
            let trimmed = rest.trim_start();
            self.offset += rest.len() - trimmed.len();
            if trimmed.starts_with('#') {
                let end = trimmed.find('\n').unwrap_or(trimmed.len());
                self.offset += end;
            } else {
                return;
            }
        }
    }

    /// The next significant character, without consuming it.
    fn peek(&mut self) -> Option<char> {
        self.skip_blank();
        self.peek_char()
    }

    fn peek_is(&mut self, token: &str) -> bool {
        self.skip_blank();
        self.rest().starts_with(token)
    }

    /// Consumes `token` if it comes next.
    fn accept(&mut self, token: &str) -> bool {
        if self.peek_is(token) {
            self.offset += token.len();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, token: &str, what: &str) -> Result<(), ParseError> {
        if self.accept(token) {
            Ok(())
        } else {
            Err(self.error(format!("expected '{token}' {what}, found {}", self.found())))
        }
    }

    /// What comes next, for error messages.
    fn found(&self) -> String {
        let rest = self.rest().trim_start();
        match rest.chars().next() {
            None => "the end of the text".into(),
            Some(_) => {
                let snippet: String = rest
                    .chars()
                    .take_while(|c| !c.is_whitespace())
                    .take(20)
                    .collect();
                format!("'{snippet}'")
            }
        }
    }

    // ---- tokens ------------------------------------------------------------------------

    /// An identifier: a letter or `_`, then letters, digits, `_` and `.` (onnx's own parser
    /// takes no dots in value names; the printer writes them, so they are accepted).
    fn identifier(&mut self, what: &str) -> Result<String, ParseError> {
        self.try_identifier()
            .ok_or_else(|| self.error(format!("expected {what}, found {}", self.found_plain())))
    }

    fn found_plain(&self) -> String {
        match self.peek_char() {
            None => "the end of the text".into(),
            Some(c) => format!("'{c}'"),
        }
    }

    fn try_identifier(&mut self) -> Option<String> {
        self.skip_blank();
        let rest = self.rest();
        let mut chars = rest.char_indices();
        match chars.next() {
            Some((_, c)) if c.is_ascii_alphabetic() || c == '_' => {}
            _ => return None,
        }
        let end = chars
            .find(|(_, c)| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '.'))
            .map_or(rest.len(), |(i, _)| i);
        self.offset += end;
        Some(rest[..end].to_string())
    }

    /// The identifier that comes next, without consuming it.
    fn peek_identifier(&mut self) -> Option<String> {
        let start = self.offset;
        let id = self.try_identifier();
        self.offset = start;
        id
    }

    /// A double-quoted string; a backslash takes the next character literally, as in onnx.
    fn quoted(&mut self) -> Result<Vec<u8>, ParseError> {
        self.skip_blank();
        let start = self.offset;
        if !self.accept("\"") {
            return Err(self.error(format!("expected a quoted string, found {}", self.found())));
        }
        let mut out = Vec::new();
        let mut chars = self.rest().char_indices();
        loop {
            match chars.next() {
                None => return Err(self.error_at(start, "unterminated string")),
                Some((i, '"')) => {
                    self.offset += i + 1;
                    return Ok(out);
                }
                Some((_, '\\')) => match chars.next() {
                    // The printer writes strings with Rust's escapes (`{:?}`).
                    Some((_, c)) if self.printed && c != 'u' => {
                        let c = match c {
                            'n' => '\n',
                            'r' => '\r',
                            't' => '\t',
                            '0' => '\0',
                            other => other,
                        };
                        out.extend(c.to_string().as_bytes())
                    }
                    Some((i, 'u')) if self.printed => {
                        let digits = self.rest()[i + 1..]
                            .strip_prefix('{')
                            .and_then(|r| r.split_once('}'))
                            .map(|(hex, _)| hex);
                        let c = digits
                            .and_then(|hex| u32::from_str_radix(hex, 16).ok())
                            .and_then(char::from_u32)
                            .ok_or_else(|| self.error_at(start, "a bad \\u{...} escape"))?;
                        let skip = digits.map_or(0, |hex| hex.len() + 2);
                        for _ in 0..skip {
                            chars.next();
                        }
                        out.extend(c.to_string().as_bytes())
                    }
                    Some((_, c)) => out.extend(c.to_string().as_bytes()),
                    None => return Err(self.error_at(start, "unterminated string")),
                },
                Some((_, c)) => out.extend(c.to_string().as_bytes()),
            }
        }
    }

    fn quoted_text(&mut self) -> Result<String, ParseError> {
        let start = self.offset;
        String::from_utf8(self.quoted()?).map_err(|_| self.error_at(start, "string is not UTF-8"))
    }

    /// A value's name (a node's input or output, a graph's input, output or initializer, a
    /// graph, a dim): `"any text"`, or a bare name of letters, digits and `_ . : / -` that
    /// does not start with `-`. Wider than onnx's identifiers: exporters name values
    /// `onnx::Mul_3` or `/fc1/Gemm_output_0`, and the printer writes names unquoted.
    fn value_name(&mut self, what: &str) -> Result<String, ParseError> {
        if self.peek() == Some('"') {
            return self.quoted_text();
        }
        let rest = self.rest();
        let end = rest
            .char_indices()
            .find(|(i, c)| {
                !(c.is_ascii_alphanumeric()
                    || matches!(c, '_' | '.' | ':' | '/')
                    || (*c == '-' && *i > 0))
            })
            .map_or(rest.len(), |(i, _)| i);
        if end == 0 {
            return Err(self.error(format!("expected {what}, found {}", self.found_plain())));
        }
        self.offset += end;
        Ok(rest[..end].to_string())
    }

    fn at_number(&mut self) -> bool {
        self.skip_blank();
        let mut chars = self.rest().chars();
        match chars.next() {
            Some(c) if c.is_ascii_digit() => true,
            Some('-') => chars.next().is_some_and(|c| c.is_ascii_digit() || c == 'i'),
            _ => false,
        }
    }

    /// An int (`-12`) or a float (`1.5`, `2.`, `1e-3`, `inf`, `-inf`, `nan`).
    fn number(&mut self) -> Result<Number, ParseError> {
        self.skip_blank();
        let start = self.offset;
        let rest = self.rest();
        let negative = rest.starts_with('-');
        let body = &rest[negative as usize..];
        for word in ["inf", "nan", "NaN"] {
            if body.starts_with(word)
                && !body[word.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
            {
                self.offset += negative as usize + word.len();
                let value = if word == "inf" {
                    f64::INFINITY
                } else {
                    f64::NAN
                };
                return Ok(Number::Float(if negative { -value } else { value }));
            }
        }
        let bytes = body.as_bytes();
        let mut end = 0;
        let digits = |end: &mut usize| {
            let from = *end;
            while *end < bytes.len() && bytes[*end].is_ascii_digit() {
                *end += 1;
            }
            *end > from
        };
        if !digits(&mut end) {
            return Err(self.error(format!("expected a number, found {}", self.found())));
        }
        let mut is_float = false;
        if end < bytes.len() && bytes[end] == b'.' {
            is_float = true;
            end += 1;
            digits(&mut end);
        }
        if end < bytes.len() && (bytes[end] == b'e' || bytes[end] == b'E') {
            let mut exponent = end + 1;
            if exponent < bytes.len() && (bytes[exponent] == b'+' || bytes[exponent] == b'-') {
                exponent += 1;
            }
            if digits(&mut exponent) {
                is_float = true;
                end = exponent;
            }
        }
        let literal = &rest[..negative as usize + end];
        self.offset += literal.len();
        if is_float {
            literal
                .parse::<f64>()
                .map(Number::Float)
                .map_err(|_| self.error_at(start, format!("'{literal}' is not a float")))
        } else {
            literal
                .parse::<i64>()
                .map(Number::Int)
                .map_err(|_| self.error_at(start, format!("'{literal}' does not fit an int64")))
        }
    }

    fn integer(&mut self, what: &str) -> Result<i64, ParseError> {
        let start = self.offset;
        match self.number()? {
            Number::Int(i) => Ok(i),
            Number::Float(_) => Err(self.error_at(start, format!("expected an integer {what}"))),
        }
    }

    /// A comma-separated list up to `close`; `item` parses one element.
    fn list<T>(
        &mut self,
        close: &str,
        what: &str,
        mut item: impl FnMut(&mut Self) -> Result<T, ParseError>,
    ) -> Result<Vec<T>, ParseError> {
        let mut items = Vec::new();
        if self.accept(close) {
            return Ok(items);
        }
        loop {
            items.push(item(self)?);
            if self.accept(close) {
                return Ok(items);
            }
            self.expect(",", &format!("or '{close}' in {what}"))?;
        }
    }

    // ---- model -------------------------------------------------------------------------

    fn model(&mut self) -> Result<ModelProto, ParseError> {
        let mut model = ModelProto::default();
        if self.accept("<") {
            self.list(">", "the model header", |p| p.header_entry(&mut model))?;
        }
        model.graph = Some(self.graph()?);
        Ok(model)
    }

    fn header_entry(&mut self, model: &mut ModelProto) -> Result<(), ParseError> {
        let start = self.offset;
        let key = self.identifier("a model header key")?;
        self.expect(":", &format!("after '{key}'"))?;
        match key.as_str() {
            "ir_version" => model.ir_version = Some(self.integer("ir_version")?),
            "model_version" => model.model_version = Some(self.integer("model_version")?),
            "producer_name" => model.producer_name = Some(self.quoted_text()?),
            "producer_version" => model.producer_version = Some(self.quoted_text()?),
            "domain" => model.domain = Some(self.quoted_text()?),
            "doc_string" => model.doc_string = Some(self.quoted_text()?),
            "opset_import" => {
                self.expect("[", "to open opset_import")?;
                model.opset_import = self.list("]", "opset_import", |p| {
                    let domain = p.quoted_text()?;
                    p.expect(":", "between an opset's domain and version")?;
                    let version = p.integer("opset version")?;
                    Ok(OperatorSetIdProto {
                        domain: Some(domain),
                        version: Some(version),
                    })
                })?;
            }
            "metadata_props" => {
                self.expect("[", "to open metadata_props")?;
                model.metadata_props = self.string_pairs()?;
            }
            _ => return Err(self.error_at(start, format!("unknown model header key '{key}'"))),
        }
        Ok(())
    }

    /// `"key": "value", ...]` (the `[` already read).
    fn string_pairs(&mut self) -> Result<Vec<StringStringEntryProto>, ParseError> {
        self.list("]", "a list of string pairs", |p| {
            let key = p.quoted_text()?;
            p.expect(":", "between a key and its value")?;
            let value = p.quoted_text()?;
            Ok(StringStringEntryProto {
                key: Some(key),
                value: Some(value),
            })
        })
    }

    // ---- graph -------------------------------------------------------------------------

    fn graph(&mut self) -> Result<GraphProto, ParseError> {
        self.nested(|p| p.graph_body())
    }

    /// Runs `inner` one level deeper, refusing beyond `MAX_DEPTH`.
    fn nested<T>(
        &mut self,
        inner: impl FnOnce(&mut Self) -> Result<T, ParseError>,
    ) -> Result<T, ParseError> {
        if self.depth >= MAX_DEPTH {
            return Err(self.error(format!("nested more than {MAX_DEPTH} levels deep")));
        }
        self.depth += 1;
        let result = inner(self);
        self.depth -= 1;
        result
    }

    fn graph_body(&mut self) -> Result<GraphProto, ParseError> {
        // The printer writes a graph without a name as nothing before its `(`.
        let name = if self.peek() == Some('(') {
            String::new()
        } else {
            self.value_name("a graph name")?
        };
        let mut graph = GraphProto {
            name: Some(name),
            ..Default::default()
        };
        self.expect("(", "to open the graph inputs")?;
        let inputs = self.list(")", "the graph inputs", |p| {
            p.value_info_or_initializer(false)
        })?;
        for (info, initializer) in inputs {
            graph.input.push(info);
            graph.initializer.extend(initializer);
        }
        self.expect("=>", "between the graph inputs and outputs")?;
        self.expect("(", "to open the graph outputs")?;
        graph.output = self.list(")", "the graph outputs", |p| p.value_info())?;
        if self.accept("<") {
            let entries = self.list(">", "the initializer list", |p| {
                p.value_info_or_initializer(p.printed)
            })?;
            for (info, initializer) in entries {
                match initializer {
                    Some(tensor) => graph.initializer.push(tensor),
                    None => graph.value_info.push(info),
                }
            }
        }
        self.expect("{", "to open the graph's nodes")?;
        while !self.accept("}") {
            if self.at_end() {
                return Err(self.error("expected '}' to close the graph's nodes"));
            }
            graph.node.push(self.node()?);
        }
        Ok(graph)
    }

    fn value_info(&mut self) -> Result<ValueInfoProto, ParseError> {
        // `? name`: a value without a type, as the printer writes it.
        let ty = if self.peek() == Some('?') && !self.rest()[1..].trim_start().starts_with('[') {
            self.offset += 1;
            None
        } else {
            Some(self.type_proto()?)
        };
        let name = self.value_name("a value name")?;
        Ok(ValueInfoProto {
            name: Some(name),
            r#type: ty,
            ..Default::default()
        })
    }

    /// `type name` or `type name = {values}` (then also an initializer); with `elided`, a
    /// value-less `type name` is an initializer of zeros.
    fn value_info_or_initializer(
        &mut self,
        elided: bool,
    ) -> Result<(ValueInfoProto, Option<TensorProto>), ParseError> {
        self.skip_blank();
        let type_start = self.offset;
        let info = self.value_info()?;
        if !self.accept("=") {
            if elided {
                // The printer writes no value infos: a value-less entry is an initializer
                // whose values it elided, read as zeros of its type and shape.
                let (elem_type, dims) = self.tensor_type_of(&info, type_start)?;
                let tensor = zeros(elem_type, dims, info.name().to_string())
                    .map_err(|message| self.error_at(type_start, message))?;
                return Ok((info, Some(tensor)));
            }
            return Ok((info, None));
        }
        let (elem_type, dims) = self.tensor_type_of(&info, type_start)?;
        let tensor = self.tensor_values(elem_type, dims, info.name().to_string())?;
        Ok((info, Some(tensor)))
    }

    /// The element type and known dims of a value info that is to hold a tensor's values.
    fn tensor_type_of(
        &self,
        info: &ValueInfoProto,
        type_start: usize,
    ) -> Result<(i32, Vec<i64>), ParseError> {
        let Some(type_proto::Value::TensorType(tensor)) =
            info.r#type.as_ref().and_then(|t| t.value.as_ref())
        else {
            return Err(self.error_at(type_start, "only a tensor can have a value"));
        };
        let dims = match &tensor.shape {
            None => {
                return Err(self.error_at(type_start, "a tensor with a value needs a shape"));
            }
            Some(shape) => shape
                .dim
                .iter()
                .map(|d| match d.value {
                    Some(dimension::Value::DimValue(v)) => Ok(v),
                    _ => Err(self.error_at(type_start, "a tensor with a value needs known dims")),
                })
                .collect::<Result<Vec<i64>, ParseError>>()?,
        };
        Ok((tensor.elem_type(), dims))
    }

    // ---- types -------------------------------------------------------------------------

    fn type_proto(&mut self) -> Result<TypeProto, ParseError> {
        self.nested(|p| p.type_body())
    }

    fn type_body(&mut self) -> Result<TypeProto, ParseError> {
        self.skip_blank();
        let start = self.offset;
        let word = self.identifier("a type")?;
        let value = match word.as_str() {
            "seq" => {
                self.expect("(", "after seq")?;
                let elem = self.type_proto()?;
                self.expect(")", "to close seq(...)")?;
                type_proto::Value::SequenceType(Box::new(type_proto::Sequence {
                    elem_type: Some(Box::new(elem)),
                }))
            }
            "optional" => {
                self.expect("(", "after optional")?;
                let elem = self.type_proto()?;
                self.expect(")", "to close optional(...)")?;
                type_proto::Value::OptionalType(Box::new(type_proto::Optional {
                    elem_type: Some(Box::new(elem)),
                }))
            }
            "map" => {
                self.expect("(", "after map")?;
                let key_start = self.offset;
                let key = self.identifier("a map key type")?;
                let key_type = element_type(&key)
                    .ok_or_else(|| self.error_at(key_start, format!("unknown type '{key}'")))?;
                self.expect(",", "after the map's key type")?;
                let value = self.type_proto()?;
                self.expect(")", "to close map(...)")?;
                type_proto::Value::MapType(Box::new(type_proto::Map {
                    key_type: Some(key_type as i32),
                    value_type: Some(Box::new(value)),
                }))
            }
            "sparse_tensor" => {
                self.expect("(", "after sparse_tensor")?;
                let elem_start = self.offset;
                let elem = self.identifier("an element type")?;
                let elem_type = element_type(&elem)
                    .ok_or_else(|| self.error_at(elem_start, format!("unknown type '{elem}'")))?;
                let shape = self.shape()?;
                self.expect(")", "to close sparse_tensor(...)")?;
                type_proto::Value::SparseTensorType(type_proto::SparseTensor {
                    elem_type: Some(elem_type as i32),
                    shape,
                })
            }
            _ => {
                let elem_type = element_type(&word)
                    .ok_or_else(|| self.error_at(start, format!("unknown type '{word}'")))?;
                type_proto::Value::TensorType(type_proto::Tensor {
                    elem_type: Some(elem_type as i32),
                    shape: self.shape()?,
                })
            }
        };
        Ok(TypeProto {
            value: Some(value),
            denotation: None,
        })
    }

    /// After an element type: nothing (a scalar: an empty shape), `[]` (unknown rank: no
    /// shape), or `[d, ...]` with `?`, a name or a size for each dim.
    fn shape(&mut self) -> Result<Option<TensorShapeProto>, ParseError> {
        // Blanks may separate the type from `[`, as onnx's parser allows.
        if !self.accept("[") {
            return Ok(Some(TensorShapeProto::default()));
        }
        if self.accept("]") {
            return Ok(None);
        }
        let dim = self.list("]", "a shape", |p| {
            let value = if p.accept("?") {
                None
            } else if p.at_number() {
                Some(dimension::Value::DimValue(p.integer("dim")?))
            } else {
                Some(dimension::Value::DimParam(
                    p.value_name("a dim (a size, a name or '?')")?,
                ))
            };
            Ok(Dimension {
                value,
                denotation: None,
            })
        })?;
        Ok(Some(TensorShapeProto { dim }))
    }

    // ---- tensors -----------------------------------------------------------------------

    /// `{v, ...}` for a tensor of `elem_type` and `dims`, stored in the typed field onnx's
    /// parser uses (float_data, int64_data, int32_data for the narrow ints, bool and 16-bit
    /// floats as their raw integer, ...).
    fn tensor_values(
        &mut self,
        elem_type: i32,
        dims: Vec<i64>,
        name: String,
    ) -> Result<TensorProto, ParseError> {
        self.skip_blank();
        let start = self.offset;
        self.expect("{", "to open the tensor's values")?;
        let values = self.list("}", "the tensor's values", |p| p.constant())?;
        let mut tensor = TensorProto {
            dims,
            data_type: Some(elem_type),
            name: Some(name),
            ..Default::default()
        };
        let expected: i64 = tensor.dims.iter().product();
        if expected != values.len() as i64 {
            return Err(self.error_at(
                start,
                format!(
                    "the tensor's shape {:?} holds {expected} values, {} given",
                    tensor.dims,
                    values.len()
                ),
            ));
        }
        let kind = DataType::try_from(elem_type).unwrap_or(DataType::Undefined);
        let number = |c: &Constant| match c {
            Constant::Number(n) => Ok(*n),
            Constant::Text(_) => Err(self.error_at(start, "a string among numbers")),
            Constant::Bool(_) => Err(self.error_at(
                start,
                format!("true or false in a {} tensor", kind.as_str_name()),
            )),
        };
        let int = |c: &Constant| match number(c)? {
            Number::Int(i) => Ok(i),
            Number::Float(_) => Err(self.error_at(
                start,
                format!("a {} tensor takes integers", kind.as_str_name()),
            )),
        };
        let float = |c: &Constant| {
            number(c).map(|n| match n {
                Number::Int(i) => i as f64,
                Number::Float(f) => f,
            })
        };
        let is_bool = |c: &Constant| matches!(c, Constant::Bool(_));
        let is_float = |c: &Constant| matches!(c, Constant::Number(Number::Float(_)));
        match (kind, storage(kind)) {
            // `{true, false}`, as the printer writes a bool tensor held as raw bytes: read back
            // as raw bytes (onnx's parser takes bools as integers, kept below).
            (DataType::Bool, _) if !values.is_empty() && values.iter().all(is_bool) => {
                let bytes = values
                    .iter()
                    .map(|v| matches!(v, Constant::Bool(true)) as u8)
                    .collect();
                tensor.raw_data = Some(bytes);
            }
            // Values written as floats (`{1.0, -0.5}`, as the printer writes 16-bit floats held
            // as raw bytes): read back as raw bytes, rounded to the type; integers keep onnx's
            // reading, below (the raw bit pattern, in int32_data).
            (DataType::Float16 | DataType::Bfloat16, _) if values.iter().any(is_float) => {
                let mut bytes = Vec::with_capacity(2 * values.len());
                for v in &values {
                    let f = float(v)?;
                    let half = if kind == DataType::Float16 {
                        half::f16::from_f64(f).to_le_bytes()
                    } else {
                        half::bf16::from_f64(f).to_le_bytes()
                    };
                    bytes.extend(half);
                }
                tensor.raw_data = Some(bytes);
            }
            (_, Some(Storage::Float)) => {
                for v in &values {
                    let f = float(v)?;
                    // Beyond float32 is what rounds to infinity: `3.4028235e38`, the shortest
                    // form of f32::MAX that the printer writes, is above it as a double.
                    if f.is_finite() && (f as f32).is_infinite() {
                        return Err(self.error_at(start, format!("{f} is beyond float32")));
                    }
                    tensor.float_data.push(f as f32);
                }
            }
            (_, Some(Storage::Double)) => {
                for v in &values {
                    tensor.double_data.push(float(v)?);
                }
            }
            (_, Some(Storage::Int64)) => {
                for v in &values {
                    tensor.int64_data.push(int(v)?);
                }
            }
            (_, Some(Storage::Int32)) => {
                for v in &values {
                    let i = int(v)?;
                    let narrow = i32::try_from(i)
                        .map_err(|_| self.error_at(start, format!("{i} does not fit int32")))?;
                    tensor.int32_data.push(narrow);
                }
            }
            (_, Some(Storage::Uint64)) => {
                for v in &values {
                    let i = int(v)?;
                    let unsigned = u64::try_from(i)
                        .map_err(|_| self.error_at(start, format!("{i} is negative")))?;
                    tensor.uint64_data.push(unsigned);
                }
            }
            (_, Some(Storage::String)) => {
                for v in &values {
                    match v {
                        Constant::Text(s) => tensor.string_data.push(s.clone()),
                        Constant::Number(_) | Constant::Bool(_) => {
                            return Err(self.error_at(start, "a string tensor takes strings"));
                        }
                    }
                }
            }
            (other, _) => {
                return Err(self.error_at(
                    start,
                    format!(
                        "values of a {} tensor are not supported",
                        other.as_str_name()
                    ),
                ));
            }
        }
        Ok(tensor)
    }

    fn constant(&mut self) -> Result<Constant, ParseError> {
        if self.peek() == Some('"') {
            Ok(Constant::Text(self.quoted()?))
        } else if self.at_word("true") || self.at_word("false") {
            let value = self.at_word("true");
            self.try_identifier();
            Ok(Constant::Bool(value))
        } else {
            Ok(Constant::Number(self.number()?))
        }
    }

    // ---- nodes -------------------------------------------------------------------------

    fn node(&mut self) -> Result<NodeProto, ParseError> {
        let mut node = NodeProto::default();
        if self.accept("[") {
            node.name = Some(self.value_name("a node name")?);
            self.expect("]", "to close the node name")?;
        }
        node.output = self.names_until("=", "the node outputs")?;
        self.skip_blank();
        let op_start = self.offset;
        let qualified = self.identifier("an op type")?;
        let (domain, op_type) = match qualified.rsplit_once('.') {
            Some((domain, op)) if !op.is_empty() => (domain.to_string(), op.to_string()),
            Some(_) => return Err(self.error_at(op_start, "an op type cannot end in '.'")),
            None => (String::new(), qualified),
        };
        node.op_type = Some(op_type);
        node.domain = Some(domain);
        if self.accept("<") {
            node.attribute = self.attributes()?;
        }
        self.expect("(", "to open the node inputs")?;
        node.input = self.names_until(")", "the node inputs")?;
        // (Read before looking for attributes after the inputs, which skips comments.)
        let mut mark = self.comment_ending_line().filter(|_| self.printed);
        if mark.is_none() && node.attribute.is_empty() && self.accept("<") {
            node.attribute = self.attributes()?;
            mark = self.comment_ending_line().filter(|_| self.printed);
        }
        if self.printed {
            if let Some(pass) = mark {
                node.metadata_props.push(StringStringEntryProto {
                    key: Some(super::PASS_KEY.to_string()),
                    value: Some(pass),
                });
            }
        }
        while self.at_branch() {
            self.branch(&mut node)?;
        }
        Ok(node)
    }

    /// The text of a `# comment` that ends the current line (after blanks, on the same line),
    /// consumed; `None` (nothing consumed) when the line ends without one.
    fn comment_ending_line(&mut self) -> Option<String> {
        let rest = self.rest();
        let after_blanks = rest.trim_start_matches([' ', '\t']);
        let comment = after_blanks.strip_prefix('#')?;
        let end = comment.find('\n').unwrap_or(comment.len());
        let text = comment[..end].trim();
        self.offset += rest.len() - comment.len() + end;
        (!text.is_empty()).then(|| text.to_string())
    }

    /// Whether a graph attribute written after its node comes next, as the printer writes an
    /// `If`'s branches: `then_branch = name (inputs) => (outputs) {...}` (or `body[0] = ...`
    /// for an element of a list of graphs). A node (`y = Relu (x)`) reads the same up to its
    /// inputs; only a graph has `=>` after them.
    fn at_branch(&mut self) -> bool {
        let start = self.offset;
        let found = (|| {
            self.try_identifier()?;
            if self.accept("[") {
                self.integer("").ok()?;
                self.accept("]").then_some(())?;
            }
            self.accept("=").then_some(())?;
            if self.peek() != Some('(') {
                self.value_name("").ok()?;
            }
            self.accept("(").then_some(())?;
            self.skip_past_close_paren()?;
            self.accept("=>").then_some(())
        })()
        .is_some();
        self.offset = start;
        found
    }

    /// After a `(`: moves past its matching `)`, over nested brackets and quoted strings.
    fn skip_past_close_paren(&mut self) -> Option<()> {
        let mut depth = 1usize;
        let mut in_string = false;
        let mut escaped = false;
        for (i, c) in self.rest().char_indices() {
            if in_string {
                match c {
                    _ if escaped => escaped = false,
                    '\\' => escaped = true,
                    '"' => in_string = false,
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => in_string = true,
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        self.offset += i + 1;
                        return Some(());
                    }
                }
                _ => {}
            }
        }
        None
    }

    /// One graph attribute written after its node (`at_branch` said one comes next).
    fn branch(&mut self, node: &mut NodeProto) -> Result<(), ParseError> {
        let name = self.identifier("a graph attribute's name")?;
        let element = if self.accept("[") {
            let start = self.offset;
            let e = self.integer("list index")?;
            self.expect("]", "to close the list index")?;
            Some((e, start))
        } else {
            None
        };
        self.expect("=", &format!("after '{name}'"))?;
        let graph = self.graph()?;
        match element {
            None => node.attribute.push(AttributeProto {
                name: Some(name),
                r#type: Some(AttributeType::Graph as i32),
                g: Some(graph),
                ..Default::default()
            }),
            Some((e, start)) => {
                let index = node
                    .attribute
                    .iter()
                    .position(|a| a.name() == name && a.r#type() == AttributeType::Graphs);
                let index = index.unwrap_or_else(|| {
                    node.attribute.push(AttributeProto {
                        name: Some(name.clone()),
                        r#type: Some(AttributeType::Graphs as i32),
                        ..Default::default()
                    });
                    node.attribute.len() - 1
                });
                let graphs = &mut node.attribute[index].graphs;
                if e != graphs.len() as i64 {
                    return Err(self.error_at(
                        start,
                        format!(
                            "'{name}[{e}]' comes where '{name}[{}]' is due",
                            graphs.len()
                        ),
                    ));
                }
                graphs.push(graph);
            }
        }
        Ok(())
    }

    /// Value names separated by commas up to `close` (consumed). A gap or `""` is an omitted
    /// optional value (the empty name); a trailing comma adds nothing, as in onnx.
    fn names_until(&mut self, close: &str, what: &str) -> Result<Vec<String>, ParseError> {
        let mut names = Vec::new();
        loop {
            if self.accept(close) {
                return Ok(names);
            }
            if self.peek_is(",") {
                names.push(String::new());
            } else {
                names.push(self.value_name(&format!("a value name in {what}"))?);
            }
            if self.accept(close) {
                return Ok(names);
            }
            self.expect(",", &format!("or '{close}' in {what}"))?;
        }
    }

    /// `name (: type)? = value, ...>` (the `<` already read).
    fn attributes(&mut self) -> Result<Vec<AttributeProto>, ParseError> {
        self.list(">", "the attributes", |p| p.attribute())
    }

    fn attribute(&mut self) -> Result<AttributeProto, ParseError> {
        let name = self.identifier("an attribute name")?;
        let declared =
            if self.accept(":") {
                self.skip_blank();
                let start = self.offset;
                let word = self.identifier("an attribute type")?;
                Some(attribute_type(&word).ok_or_else(|| {
                    self.error_at(start, format!("unknown attribute type '{word}'"))
                })?)
            } else {
                None
            };
        self.expect("=", &format!("after attribute '{name}'"))?;
        self.skip_blank();
        let start = self.offset;
        let mut attribute = AttributeProto {
            name: Some(name.clone()),
            ..Default::default()
        };
        let mismatch = |p: &Self, found: AttributeType| {
            p.error_at(
                start,
                format!(
                    "attribute '{name}' is declared {} but its value is {}",
                    declared.map_or("?", |d| d.as_str_name()),
                    found.as_str_name()
                ),
            )
        };
        let found = if self.accept("@") {
            attribute.ref_attr_name = Some(self.identifier("the referenced attribute")?);
            attribute.r#type = declared.map(|d| d as i32);
            return Ok(attribute);
        } else if self.printed && self.at_tensor_list() {
            // The printer writes a list of tensors as `[float[2] = {1.0, 2.0}, ...]`.
            self.expect("[", "to open the tensors")?;
            attribute.tensors =
                self.list("]", "the attribute's tensors", |p| p.tensor_constant())?;
            AttributeType::Tensors
        } else if self.accept("[") {
            let items = self.list("]", "the attribute's list", |p| p.list_item())?;
            let kind = match (declared, items.first()) {
                (Some(d), _) => d,
                (None, Some(Constant::Text(_))) => AttributeType::Strings,
                (None, Some(Constant::Number(Number::Int(_)))) => AttributeType::Ints,
                (None, Some(Constant::Number(Number::Float(_)))) => AttributeType::Floats,
                (None, Some(Constant::Bool(_))) => return Err(mismatch(self, AttributeType::Ints)),
                // The printer writes any empty list as `[]`, its type unknown; it prints the
                // same whatever its type.
                (None, None) if self.printed => AttributeType::Ints,
                (None, None) => {
                    return Err(self.error_at(
                        start,
                        format!("the empty list of '{name}' needs a type (': ints')"),
                    ))
                }
            };
            for item in items {
                match (kind, item) {
                    (AttributeType::Ints, Constant::Number(Number::Int(i))) => {
                        attribute.ints.push(i)
                    }
                    (AttributeType::Floats, Constant::Number(Number::Int(i))) => {
                        attribute.floats.push(i as f32)
                    }
                    (AttributeType::Floats, Constant::Number(Number::Float(f))) => {
                        attribute.floats.push(f as f32)
                    }
                    (AttributeType::Strings, Constant::Text(s)) => attribute.strings.push(s),
                    (AttributeType::Tensors | AttributeType::Graphs, _) => {
                        return Err(
                            self.error_at(start, "lists of tensors or graphs are not supported")
                        )
                    }
                    (_, Constant::Text(_)) => return Err(mismatch(self, AttributeType::Strings)),
                    (_, Constant::Bool(_)) => return Err(mismatch(self, AttributeType::Ints)),
                    (_, Constant::Number(Number::Int(_))) => {
                        return Err(mismatch(self, AttributeType::Ints))
                    }
                    (_, Constant::Number(Number::Float(_))) => {
                        return Err(mismatch(self, AttributeType::Floats))
                    }
                }
            }
            kind
        } else if self.peek() == Some('"') {
            attribute.s = Some(self.quoted()?);
            AttributeType::String
        } else if self.at_number() || self.at_float_word() {
            match (self.number()?, declared) {
                (Number::Int(i), None | Some(AttributeType::Int)) => {
                    attribute.i = Some(i);
                    AttributeType::Int
                }
                (Number::Int(i), Some(AttributeType::Float)) => {
                    attribute.f = Some(i as f32);
                    AttributeType::Float
                }
                (Number::Float(f), None | Some(AttributeType::Float)) => {
                    attribute.f = Some(f as f32);
                    AttributeType::Float
                }
                (Number::Int(_), Some(_)) => return Err(mismatch(self, AttributeType::Int)),
                (Number::Float(_), Some(_)) => return Err(mismatch(self, AttributeType::Float)),
            }
        } else {
            let word = self
                .peek_identifier()
                .ok_or_else(|| self.error(format!("expected a value for attribute '{name}'")))?;
            if element_type(&word).is_some() {
                attribute.t = Some(self.tensor_constant()?);
                AttributeType::Tensor
            } else {
                attribute.g = Some(self.graph()?);
                AttributeType::Graph
            }
        };
        if let Some(d) = declared {
            if d != found {
                return Err(mismatch(self, found));
            }
        }
        attribute.r#type = Some(found as i32);
        Ok(attribute)
    }

    fn at_word(&mut self, word: &str) -> bool {
        self.peek_identifier().as_deref() == Some(word)
    }

    /// `[` and a tensor type: a list of tensors.
    fn at_tensor_list(&mut self) -> bool {
        let start = self.offset;
        let found = self.accept("[")
            && self
                .peek_identifier()
                .is_some_and(|w| element_type(&w).is_some());
        self.offset = start;
        found
    }

    /// `inf`, `nan`, or `NaN` (Rust's spelling, which the printer writes).
    fn at_float_word(&mut self) -> bool {
        matches!(
            self.peek_identifier().as_deref(),
            Some("inf" | "nan" | "NaN")
        )
    }

    /// An element of an attribute list: a number or a string.
    fn list_item(&mut self) -> Result<Constant, ParseError> {
        if self.peek() == Some('"') || self.at_number() || self.at_float_word() {
            self.constant()
        } else {
            Err(self.error(format!(
                "expected a number or a string in the list, found {} (lists of tensors or graphs are not supported)",
                self.found()
            )))
        }
    }

    /// `float[2] {1, 2}` or `float[2] name = {1, 2}` as an attribute value.
    fn tensor_constant(&mut self) -> Result<TensorProto, ParseError> {
        self.skip_blank();
        let start = self.offset;
        let word = self.identifier("a tensor type")?;
        let elem_type = element_type(&word)
            .ok_or_else(|| self.error_at(start, format!("unknown type '{word}'")))?;
        let dims = match self.shape()? {
            None => Vec::new(),
            Some(shape) => shape
                .dim
                .iter()
                .map(|d| match d.value {
                    Some(dimension::Value::DimValue(v)) => Ok(v),
                    _ => Err(self.error_at(start, "a tensor constant needs known dims")),
                })
                .collect::<Result<_, _>>()?,
        };
        if self.printed && matches!(self.peek(), Some(',' | '>' | ']')) {
            // A tensor whose values the printer elided: zeros, as for an initializer.
            return zeros(elem_type as i32, dims, String::new())
                .map_err(|message| self.error_at(start, message));
        }
        let name = if self.peek() == Some('{') || self.peek() == Some('=') {
            String::new()
        } else {
            self.value_name("a tensor name or '{'")?
        };
        self.accept("=");
        self.tensor_values(elem_type as i32, dims, name)
    }
}

/// The `TensorProto.DataType` of a type keyword (the printer's names, `print::elem_type_name`).
fn element_type(word: &str) -> Option<DataType> {
    (1..=32)
        .filter_map(|code| DataType::try_from(code).ok())
        .find(|d| super::print::elem_type_name(*d as i32) == word)
}

/// Most elements an elided initializer is filled with (a hostile `float[1000000000000] w` is
/// an error, not an allocation that fails).
const MAX_ELIDED_ELEMENTS: i64 = 1 << 26;

/// Where a TensorProto of one element type keeps its values when they are not raw bytes
/// (ONNX's typed fields; 8- and 16-bit types and bool widen into `int32_data`), or raw bytes
/// of `bits` per element for the types no typed field holds. One table for the literal
/// reader and the elided zeros, so that both store a type where the printer looks for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Storage {
    Float,
    Double,
    Int64,
    Int32,
    Uint64,
    String,
    Raw { bits: usize },
}

fn storage(kind: DataType) -> Option<Storage> {
    Some(match kind {
        DataType::Float => Storage::Float,
        DataType::Double => Storage::Double,
        DataType::Int64 => Storage::Int64,
        DataType::Int32
        | DataType::Int16
        | DataType::Int8
        | DataType::Uint16
        | DataType::Uint8
        | DataType::Bool
        | DataType::Float16
        | DataType::Bfloat16 => Storage::Int32,
        DataType::Uint32 | DataType::Uint64 => Storage::Uint64,
        DataType::String => Storage::String,
        DataType::Complex64 => Storage::Raw { bits: 64 },
        DataType::Complex128 => Storage::Raw { bits: 128 },
        DataType::Float8e4m3fn
        | DataType::Float8e4m3fnuz
        | DataType::Float8e5m2
        | DataType::Float8e5m2fnuz
        | DataType::Float8e8m0 => Storage::Raw { bits: 8 },
        DataType::Uint4 | DataType::Int4 | DataType::Float4e2m1 => Storage::Raw { bits: 4 },
        DataType::Uint2 | DataType::Int2 => Storage::Raw { bits: 2 },
        DataType::Undefined => return None,
    })
}

/// Zeros of `elem_type` and `dims`: what an initializer whose values the printer elided
/// reads as. They are stored where `tensor_values` stores that type's values (raw bytes for
/// the types it takes no values of), so that they print elided again.
fn zeros(elem_type: i32, dims: Vec<i64>, name: String) -> Result<TensorProto, String> {
    let count = dims
        .iter()
        .try_fold(1i64, |acc, d| {
            (*d >= 0).then(|| acc.checked_mul(*d)).flatten()
        })
        .filter(|n| *n <= MAX_ELIDED_ELEMENTS)
        .ok_or_else(|| {
            format!("an elided initializer of shape {dims:?} is too large to fill with zeros")
        })? as usize;
    let mut tensor = TensorProto {
        dims,
        data_type: Some(elem_type),
        name: Some(name),
        ..Default::default()
    };
    let kind = DataType::try_from(elem_type).unwrap_or(DataType::Undefined);
    match storage(kind) {
        Some(Storage::Float) => tensor.float_data = vec![0.0; count],
        Some(Storage::Double) => tensor.double_data = vec![0.0; count],
        Some(Storage::Int64) => tensor.int64_data = vec![0; count],
        Some(Storage::Int32) => tensor.int32_data = vec![0; count],
        Some(Storage::Uint64) => tensor.uint64_data = vec![0; count],
        Some(Storage::String) => tensor.string_data = vec![Vec::new(); count],
        Some(Storage::Raw { bits }) => {
            tensor.raw_data = Some(vec![0u8; (count * bits).div_ceil(8)])
        }
        None => return Err("an elided initializer needs an element type".into()),
    }
    Ok(tensor)
}

fn attribute_type(word: &str) -> Option<AttributeType> {
    Some(match word {
        "int" => AttributeType::Int,
        "float" => AttributeType::Float,
        "string" => AttributeType::String,
        "tensor" => AttributeType::Tensor,
        "graph" => AttributeType::Graph,
        "ints" => AttributeType::Ints,
        "floats" => AttributeType::Floats,
        "strings" => AttributeType::Strings,
        "tensors" => AttributeType::Tensors,
        "graphs" => AttributeType::Graphs,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "<ir_version: 8, opset_import: [\"\" : 17]>\n";

    fn graph_of(body: &str) -> GraphProto {
        parse_model(&format!("{HEADER}{body}"))
            .unwrap_or_else(|e| panic!("{e}"))
            .graph
            .unwrap()
    }

    fn error_of(body: &str) -> String {
        parse_model(&format!("{HEADER}{body}"))
            .expect_err("an error")
            .to_string()
    }

    #[test]
    fn errors_name_line_and_column() {
        assert_eq!(
            error_of("g (float X) => (float Y) {\n  Y = Relu(X\n}"),
            "4:1: expected ',' or ')' in the node inputs, found '}'"
        );
        assert_eq!(
            error_of("g (floot X) => (float Y) { Y = Relu(X) }"),
            "2:4: unknown type 'floot'"
        );
        assert_eq!(
            error_of("g (float X) => (float Y) { Y = Relu <alpha: int = 0.5> (X) }"),
            "2:51: attribute 'alpha' is declared INT but its value is FLOAT"
        );
        assert_eq!(
            error_of("g () => (float Y) <float[2] W = {1}> { Y = Relu(W) }"),
            "2:33: the tensor's shape [2] holds 2 values, 1 given"
        );
        assert_eq!(
            error_of("g (float X) => (float Y) { Y = Relu(X) } extra"),
            "2:42: expected the end of the text after the graph"
        );
    }

    /// Each tests/data/text/<case>.onnxtxt parses to the proto onnx's own parser made of it
    /// (the .onnx beside it, from scripts/text-parser-references.py).
    #[test]
    fn matches_onnx_parser_references() {
        use prost::Message;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/text");
        let mut checked = Vec::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) != Some("onnxtxt") {
                continue;
            }
            let source = std::fs::read_to_string(&path).unwrap();
            let ours = parse_model(&source).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let bytes = std::fs::read(path.with_extension("onnx")).unwrap();
            let reference = ModelProto::decode(bytes.as_slice()).unwrap();
            assert_eq!(ours, reference, "{}", path.display());
            checked.push(path.file_stem().unwrap().to_string_lossy().into_owned());
        }
        checked.sort();
        assert_eq!(
            checked,
            [
                "attributes",
                "header",
                "if_subgraph",
                "initializers",
                "nodes",
                "types"
            ]
        );
    }

    /// Every prefix of every reference text is parsed or refused, never a panic; deep
    /// nesting is refused.
    #[test]
    fn truncated_and_nested_texts_are_errors_not_panics() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/text");
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) != Some("onnxtxt") {
                continue;
            }
            let source = std::fs::read_to_string(&path).unwrap();
            for (end, _) in source.char_indices() {
                let _ = parse_model(&source[..end]);
            }
        }
        let deep = format!(
            "{HEADER}g ({}float{} x) => () {{}}",
            "seq(".repeat(1000),
            ")".repeat(1000)
        );
        let e = parse_model(&deep).expect_err("too deep").to_string();
        assert!(e.contains("nested more than 64 levels deep"), "{e}");
    }

    #[test]
    fn columns_count_characters() {
        assert_eq!(
            error_of("g (float \"é\") => (float Y) { Y = Relu(X) ! }"),
            "2:42: expected a value name in the node outputs, found '!'"
        );
    }

    #[test]
    fn numbers_keep_their_kind() {
        let g = graph_of(
            "g (float X) => (float Y) { Y = Foo <a = 2, b = 2., c = -1e-3, d = -inf, e: float = 3> (X) }",
        );
        let a = &g.node[0].attribute;
        assert_eq!((a[0].r#type(), a[0].i()), (AttributeType::Int, 2));
        assert_eq!((a[1].r#type(), a[1].f()), (AttributeType::Float, 2.0));
        assert_eq!(a[2].f(), -1e-3);
        assert_eq!(a[3].f(), f32::NEG_INFINITY);
        assert_eq!((a[4].r#type(), a[4].f()), (AttributeType::Float, 3.0));
    }

    #[test]
    fn empty_optional_inputs_are_empty_names() {
        let g = graph_of("g (float X) => (float Y) { Y = Foo (, X, \"\", X,) }");
        assert_eq!(g.node[0].input, ["", "X", "", "X"]);
    }

    fn printed_graph_of(body: &str) -> GraphProto {
        parse_printed(&format!("{HEADER}{body}"))
            .unwrap_or_else(|e| panic!("{e}"))
            .graph
            .unwrap()
    }

    /// The two readings that differ between the dialects: a value-less entry of `<...>` and
    /// a comment that ends a node's line.
    #[test]
    fn elided_initializers_and_pass_marks_only_when_printed() {
        let text = "g (float[2] x) => (float[2] y)\n<float[3,4] w, int64[2] k = {1, 2}>\n{\n  y = Add (x, w)  # grad-accum\n  z = Neg (y)\n}";
        let printed = printed_graph_of(text);
        assert!(printed.value_info.is_empty());
        let w = &printed.initializer[0];
        assert_eq!((w.name(), w.dims.as_slice()), ("w", &[3i64, 4][..]));
        assert_eq!(w.float_data, vec![0.0; 12]);
        assert_eq!(printed.initializer[1].int64_data, [1, 2]);
        let mark = &printed.node[0].metadata_props;
        assert_eq!(mark.len(), 1);
        assert_eq!(
            (mark[0].key(), mark[0].value()),
            (crate::ir::PASS_KEY, "grad-accum")
        );
        assert!(printed.node[1].metadata_props.is_empty());

        let onnx = graph_of(text);
        assert_eq!(onnx.value_info.len(), 1);
        assert_eq!(onnx.initializer.len(), 1);
        assert!(onnx.node[0].metadata_props.is_empty());
    }

    #[test]
    fn elided_values_of_every_kind_are_zeros() {
        let g = printed_graph_of(
            "g () => ()\n<int64[9] a, bool[9] b, float16[9] c, string[2] d, complex64[1] e, uint4[3] f>\n{\n  y = Foo <t = float[10], ts = [int64[9], float[1] = {1.0}]> ()\n}",
        );
        let i = &g.initializer;
        assert_eq!(i[0].int64_data, vec![0; 9]);
        assert_eq!((i[1].int32_data.len(), i[2].int32_data.len()), (9, 9));
        assert_eq!(i[3].string_data, vec![Vec::<u8>::new(); 2]);
        assert_eq!(i[4].raw_data(), [0u8; 8]);
        assert_eq!(i[5].raw_data(), [0u8; 2]);
        let a = &g.node[0].attribute;
        assert_eq!(a[0].t.as_ref().unwrap().float_data, vec![0.0; 10]);
        assert_eq!(a[1].r#type(), AttributeType::Tensors);
        assert_eq!(a[1].tensors[0].int64_data, vec![0; 9]);
        assert_eq!(a[1].tensors[1].float_data, [1.0]);
        let e = parse_printed(&format!(
            "{HEADER}g () => ()\n<float[1000000,1000000] huge>\n{{\n}}"
        ))
        .expect_err("too large")
        .to_string();
        assert_eq!(
            e,
            "3:2: an elided initializer of shape [1000000, 1000000] is too large to fill with zeros"
        );
    }

    #[test]
    fn printed_strings_use_rust_escapes() {
        let text = r#"g () => () { y = Foo <s = "a\nb\t\"\\\u{1b}é"> () }"#;
        let printed = printed_graph_of(text);
        assert_eq!(
            printed.node[0].attribute[0].s(),
            "a\nb\t\"\\\u{1b}é".as_bytes()
        );
        // onnx's reading: a backslash takes the next character.
        assert_eq!(
            graph_of(text).node[0].attribute[0].s(),
            "anbt\"\\u{1b}é".as_bytes()
        );
    }

    /// Readings both dialects share, since onnx's text has no meaning for them.
    #[test]
    fn printer_forms_onnx_text_lacks() {
        for g in [graph_of(DIALECT_SAMPLE), printed_graph_of(DIALECT_SAMPLE)] {
            assert_eq!(g.input[0].name(), "onnx::Mul_3/x:0");
            assert_eq!(g.input[1].r#type, None);
            let flags = &g.initializer[0];
            assert_eq!(flags.raw_data(), [1, 0]);
            assert_eq!(g.initializer[1].int32_data, [1, 0]);
            assert_eq!(
                g.initializer[2].raw_data(),
                [half::f16::from_f32(1.5), half::f16::from_f32(-0.0)]
                    .iter()
                    .flat_map(|h| h.to_le_bytes())
                    .collect::<Vec<_>>()
            );
            assert_eq!(g.initializer[3].int32_data, [15360]);
            assert!(g.initializer[4].float_data[0].is_nan());
            assert_eq!(g.initializer[4].float_data[1], f32::MAX);
            let node = &g.node[0];
            assert_eq!(node.op_type(), "If");
            let names: Vec<&str> = node.attribute.iter().map(|a| a.name()).collect();
            assert_eq!(names, ["else_branch", "then_branch"]);
            assert_eq!(node.attribute[0].g.as_ref().unwrap().name(), "");
            assert_eq!(g.node[1].output, ["then_branch"]);
            assert!(g.node[2].attribute[0].f().is_nan());
        }
    }

    const DIALECT_SAMPLE: &str = "g (float onnx::Mul_3/x:0, ? untyped, bool c) => (float y)
<bool[2] flags = {true, false}, bool[2] ints = {1, 0}, float16[2] h = {1.5, -0.0}, float16 bits = {15360}, float[2] f = {NaN, 3.4028235e38}>
{
  y = If (c)
    else_branch =  () => (float e)
    {
      e = Identity (onnx::Mul_3/x:0)
    }
    then_branch = then () => (float t) {
      t = Neg (onnx::Mul_3/x:0)
    }
  then_branch = Identity (y)
  z = Foo <a = NaN> (y)
}";

    /// Every prefix of printed text is parsed or refused by `parse_printed`, never a panic.
    #[test]
    fn truncated_printed_texts_are_errors_not_panics() {
        let text = format!("{HEADER}{DIALECT_SAMPLE}");
        for (end, _) in text.char_indices() {
            let _ = parse_printed(&text[..end]);
            let _ = parse_model(&text[..end]);
        }
        assert!(parse_printed(&text).is_ok());
    }

    #[test]
    fn dotted_names_and_qualified_ops() {
        let g = graph_of("g (float w.m) => (float Y) { Y = com.microsoft.Gelu (w.m) }");
        assert_eq!(g.node[0].input, ["w.m"]);
        assert_eq!(g.node[0].domain(), "com.microsoft");
        assert_eq!(g.node[0].op_type(), "Gelu");
    }
}
