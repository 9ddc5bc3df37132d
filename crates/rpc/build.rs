//! Generates the gRPC messages and services from `proto/` with protox (a Rust protobuf
//! compiler: no `protoc` on the build machine).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let files = [
        "dsec/v1/sandbox.proto",
        "dsec/v1/cluster.proto",
        "dsec/v1/iam.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={}", root.join(f).display());
    }
    let fds = protox::compile(files, [&root])?;
    tonic_prost_build::configure()
        // The API's types keep maps sorted; so do the messages, and they move across as is.
        .btree_map(".")
        .build_transport(false)
        .generate_default_stubs(true)
        .compile_fds(fds)?;
    Ok(())
}
