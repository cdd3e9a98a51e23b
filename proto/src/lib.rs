pub mod hash {}
