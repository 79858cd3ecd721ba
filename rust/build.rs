//! Compiles the wire contract (`proto/pstore/v1/pstore.proto`) into Rust with protox, a pure-Rust
//! protobuf compiler, so building the wheel needs no `protoc` on the machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/pstore/v1/pstore.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .bytes(".pstore.v1")
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
