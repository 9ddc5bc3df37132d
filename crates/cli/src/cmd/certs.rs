//! `dsec certs`: the cluster CA and one certificate per component.

use std::path::PathBuf;

use anyhow::Result;
use dsec_mtls::{Role, pki};

use crate::output;

#[derive(clap::Subcommand)]
pub enum CertsCommand {
    /// Create the cluster CA (ca.pem, ca.key) in DIR, unless one is there
    #[command(after_help = "Example:\n  dsec certs init --dir /etc/dsec/certs")]
    Init {
        /// Where the CA and the certificates live
        #[arg(long)]
        dir: PathBuf,
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// Issue a component's certificate and key (NAME.pem, NAME.key), signed by the CA in DIR
    #[command(
        after_help = "Example:\n  dsec certs issue --dir /etc/dsec/certs --role edge --name edge1 --host 10.0.0.7 --host node7.example.net\n\nCopy ca.pem, NAME.pem and NAME.key to the component's machine; ca.key stays here."
    )]
    Issue {
        #[arg(long)]
        dir: PathBuf,
        /// iam, apiserver, watcher or edge
        #[arg(long, value_parser = parse_role)]
        role: Role,
        /// The component's name (an edge's is its node name)
        #[arg(long)]
        name: String,
        /// An IP address or DNS name others reach it by (repeatable)
        #[arg(long = "host")]
        hosts: Vec<String>,
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
}

fn parse_role(s: &str) -> Result<Role, String> {
    s.parse().map_err(|e: dsec_mtls::Error| e.to_string())
}

pub fn run(c: CertsCommand) -> Result<i32> {
    match c {
        CertsCommand::Init { dir, json } => {
            let created = pki::init_ca(&dir)?;
            if json {
                output::print_json(&serde_json::json!({
                    "created": created,
                    "ca": dir.join(pki::CA_CERT),
                    "ca_key": dir.join(pki::CA_KEY),
                }));
            } else if created {
                println!("Created the cluster CA in {}.", dir.display());
                println!(
                    "Keep {} private; give ca.pem to every component.",
                    dir.join(pki::CA_KEY).display()
                );
            } else {
                println!("{} already holds a CA; kept it.", dir.display());
            }
        }
        CertsCommand::Issue {
            dir,
            role,
            name,
            hosts,
            json,
        } => {
            let i = pki::issue(&dir, role, &name, &hosts)?;
            if json {
                output::print_json(&serde_json::json!({
                    "identity": i.identity.uri(),
                    "cert": i.cert,
                    "key": i.key,
                    "ca": dir.join(pki::CA_CERT),
                }));
            } else {
                println!("Issued {} ({}):", i.identity, i.identity.uri());
                println!("  certificate {}", i.cert.display());
                println!("  key         {}", i.key.display());
            }
        }
    }
    Ok(0)
}
