//! The `onnx-ga` command line: parse, call the library, print. Exit codes: 0 success,
//! 2 bad input (unreadable or inconsistent files, bad arguments), 1 anything else.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use onnx_ga::signature::{self, ExplicitRoles};

#[derive(Parser)]
#[command(
    name = "onnx-ga",
    version,
    about = "Rewrite ONNX training graphs into gradient-accumulation training steps"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show what a training graph contains: data, loss, seed, parameters, optimizer, ops.
    Inspect(InspectArgs),
}

#[derive(Args)]
struct InspectArgs {
    /// An ONNX Runtime training artifacts folder or an .onnx gradient graph.
    path: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Also print the graph in ONNX textual syntax.
    #[arg(long)]
    graph: bool,
    #[command(flatten)]
    roles: RoleArgs,
}

/// Roles of a plain gradient graph (not needed for ONNX Runtime artifacts).
#[derive(Args)]
struct RoleArgs {
    /// The loss tensor of a plain gradient graph.
    #[arg(long)]
    loss: Option<String>,
    /// The scalar initializer that seeds the backward pass.
    #[arg(long)]
    seed: Option<String>,
    /// PARAM=TENSOR: the gradient tensor of a parameter (repeatable).
    #[arg(long = "grad", value_parser = parse_grad)]
    grads: Vec<(String, String)>,
}

impl RoleArgs {
    fn roles(&self) -> ExplicitRoles {
        ExplicitRoles {
            loss: self.loss.clone(),
            seed: self.seed.clone(),
            grads: self.grads.clone(),
        }
    }
}

fn parse_grad(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((p, g)) if !p.is_empty() && !g.is_empty() => Ok((p.to_string(), g.to_string())),
        _ => Err(format!("expected PARAM=TENSOR, got '{s}'")),
    }
}

/// An error with the exit code it deserves.
struct Failure {
    code: u8,
    error: anyhow::Error,
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(e: E) -> Self {
        let error = e.into();
        // Everything the library reports about files and graphs is a problem of the input.
        let input_error = error.downcast_ref::<signature::SignatureError>().is_some()
            || error.downcast_ref::<onnx_ga::model::ModelError>().is_some()
            || error
                .downcast_ref::<onnx_ga::checkpoint::CheckpointError>()
                .is_some()
            || error
                .downcast_ref::<onnx_ga::ir::verify::VerifyErrors>()
                .is_some();
        Failure {
            code: if input_error { 2 } else { 1 },
            error,
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure { code, error }) => {
            eprintln!("error: {error:#}");
            ExitCode::from(code)
        }
    }
}

fn run(cli: Cli) -> Result<(), Failure> {
    match cli.command {
        Command::Inspect(args) => inspect(args),
    }
}

fn inspect(args: InspectArgs) -> Result<(), Failure> {
    let graph = signature::open(&args.path, &args.roles.roles())?;
    let report = onnx_ga::inspect::report(&graph);
    if args.json {
        let mut value = serde_json::to_value(&report)?;
        if args.graph {
            value["graph"] =
                serde_json::Value::String(onnx_ga::ir::print::print_model(&graph.model));
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print!("{}", onnx_ga::inspect::render_text(&report));
        if args.graph {
            println!();
            print!("{}", onnx_ga::ir::print::print_model(&graph.model));
        }
    }
    Ok(())
}
