//! boto3's bedrock-runtime client (Converse) against a live server (router/tests/converse_boto3.py).

mod support;

#[test]
fn boto3_bedrock_runtime_converse_works_unmodified() {
    support::run_sdk_script("boto3/__init__.py", "converse_boto3.py", "");
}
