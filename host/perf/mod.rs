pub mod check;
pub mod table;
